"""The benchmark suite: shardpoint against its peers and the machine's own limits.

``make bench`` runs ``bench/suite.py``; ``make bench-quick`` runs ``bench/suite.py --quick``.
The driver runs the pieces as separate processes, one at a time, each holding
an exclusive lock (``--lock``, the same file that ``flock(1)`` uses) for as
long as it runs, so that benchmarks of several people on one machine never
overlap and can still interleave between pieces:

1. ``limits``: ``bench/limits.py``: memory copy into a preallocated buffer,
   sequential write + fsync, sequential read cold and cached. Every other
   result is also shown as a fraction of one of these.
2. ``single``: ``bench/bench_single.py``: one process; anchor ``torch.save``
   / ``torch.load``; peers safetensors and shardpoint.
3. ``sync``: ``bench/bench_sync.py`` per size and layout (FSDP2, DDP, 2-D
   FSDP2 x TP, 4 ranks): save, same-layout load (cold, warm), resharding
   load into FSDP2 on 2 ranks; anchor DCP.
4. ``async``: ``bench/bench_async.py`` per size and layout: stall, overhead
   and time to durable while training; anchor DCP ``async_save`` (thread
   executor); peers DCP process executor and ByteCheckpoint 0.0.2.
5. ``load``: ``bench/bench_load.py`` per size: an FSDP2 checkpoint into FSDP2
   x 4, TP x 2 (resharding) and DDP x 4 (replicated); bytes read; anchor DCP;
   peer ByteCheckpoint.

Each piece repeats its measurements (3 to 5 repeats, or 3 checkpoints per
system while training); the tables give median [min, max] over them. Results go to one JSON (``--json``), three PNG
plots (``--plots``: stall, throughput, bytes read per system) and a markdown
table on stdout. ``--merge`` adds this run's entries to an earlier JSON (same
part, size and layout replaced), so a suite can be assembled from partial
runs; ``--report-only`` redraws tables and plots from a JSON. After a run
with the async part it prints shardpoint's eager and lazy stall and call
times beside those last recorded in the ``--json`` file (and their commit),
so a slower call is seen even though it fails nothing.

    .venv/bin/python bench/suite.py --quick           # < 10 min: 100 MB state, FSDP2 for async and load
    .venv/bin/python bench/suite.py                   # everything: 100 MB and 1.5 GB, three layouts
    .venv/bin/python bench/suite.py --sizes 1.5gb --parts single,sync --merge bench/results/suite.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import report as R  # noqa: E402

PARTS = ("limits", "single", "sync", "async", "load")
SIZES = ("100mb", "1.5gb")
LAYOUTS = ("fsdp2", "ddp", "2d")
SIZE_LABEL = {"100mb": "100 MB", "1.5gb": "1.5 GB"}
LAYOUT_LABEL = {"fsdp2": "FSDP2 x4", "ddp": "DDP x4", "2d": "2-D FSDP2 x TP (2x2)"}
ASYNC_SYSTEMS = ("sp-eager", "sp-lazy", "dcp-thread", "dcp-process", "bcp")
ASYNC_LABEL = {"sp-eager": "shardpoint eager", "sp-lazy": "shardpoint lazy", "dcp-thread": "DCP thread",
               "dcp-process": "DCP process", "bcp": "ByteCheckpoint", "sp-lazy-small": "shardpoint lazy, small ring",
               "sp-eager-small": "shardpoint eager, small ring", "dcp-thread-stager": "DCP thread + stager"}
LOAD_LABEL = {"sp-share": "shardpoint (share_reads)", "sp-noshare": "shardpoint (no sharing)", "sp-noverify": "shardpoint (no verify)",
              "dcp": "DCP", "bcp": "ByteCheckpoint"}
DEFAULT_LOCK = os.path.join(tempfile.gettempdir(), "shardpoint-bench.lock")


# ====================================================================== the plan
def plan(quick: bool, sizes, parts, layouts) -> list[dict]:
    """The pieces to run: part, size, layout and the script's arguments (without --json)."""
    out: list[dict] = []
    if "limits" in parts:
        out.append({"part": "limits", "size": None, "layout": None,
                    "args": ["bench/limits.py", "--mb", "512" if quick else "1024", "--repeats", "3"]})
    for size in sizes:
        big = size == "1.5gb"
        if "single" in parts:
            out.append({"part": "single", "size": size, "layout": "single",
                        "args": ["bench/bench_single.py", "--size", size, "--repeats", "3" if (quick or big) else "5"]})
        if "sync" in parts:
            for layout in layouts:
                reps, warm = ("3", "0") if quick else (("3", "1") if big else ("5", "1"))
                a = ["bench/bench_sync.py", "--size", size, "--layout", layout, "--repeats", reps, "--warmup", warm,
                     "--no-disk-probe"]
                if quick:
                    a += ["--max-wait", "5", "--wait-budget", "10"]
                out.append({"part": "sync", "size": size, "layout": layout, "args": a})
        if "async" in parts:
            for layout in (("fsdp2",) if quick else layouts):
                if layout not in layouts:
                    continue
                systems = [s for s in ASYNC_SYSTEMS if not (s == "bcp" and layout == "2d")]
                a = ["bench/bench_async.py", "--size", size, "--layout", layout, "--systems", ",".join(systems),
                     "--checkpoints", "3", "--every", "5" if (quick or big) else "10"]
                out.append({"part": "async", "size": size, "layout": layout, "args": a})
        if "load" in parts:
            out.append({"part": "load", "size": size, "layout": "fsdp2",
                        "args": ["bench/bench_load.py", "--size", size, "--repeats", "2" if quick else "3",
                                 "--systems", "sp-share,sp-noshare,dcp,bcp"]})
    return out


# ====================================================================== running
class Lock:
    """An exclusive flock(2) on ``path`` (compatible with ``flock(1)``) while a piece runs."""

    def __init__(self, path: str | None):
        self.path = path
        self.fd = None

    def __enter__(self):
        if self.path:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            t = time.monotonic()
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"# waiting for the benchmark lock {self.path} (another benchmark is running)", flush=True)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            self.waited = time.monotonic() - t
        else:
            self.waited = 0.0
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _slim(part: str, res: dict) -> dict:
    """The result without its bulky per-round raw data (kept in the scripts' own JSONs)."""
    res = dict(res)
    res.pop("raw", None)
    if isinstance(res.get("command"), str):  # name no temporary (machine) path
        res["command"] = " ".join(os.path.basename(a) if a.startswith(os.sep) else a for a in res["command"].split())
    if part == "async":
        res["systems"] = [{k: v for k, v in s.items() if k != "windows"} for s in res.get("systems", [])]
    return res


def run_piece(piece: dict, tmp: str, lock: str | None, timeout: float) -> dict:
    out = os.path.join(tmp, f"{piece['part']}-{piece['size']}-{piece['layout']}.json")
    args = list(piece["args"])
    if piece["part"] in ("single",) and os.path.exists(os.path.join(tmp, "limits.json")):
        args += ["--limits", os.path.join(tmp, "limits.json")]
    cmd = [sys.executable] + args + ["--json", out]
    # Temporary paths shortened to their file names, so that the results name no machine path.
    shown = " ".join(os.path.basename(a) if os.sep in a and not a.startswith("bench") else a for a in args)
    print(f"\n## {piece['part']} {piece['size'] or ''} {piece['layout'] or ''}: .venv/bin/python {shown}", flush=True)
    entry = {k: piece[k] for k in ("part", "size", "layout")}
    entry["command"] = shown
    with Lock(lock) as lk:
        t = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        entry["wall_s"] = round(time.monotonic() - t, 1)
        entry["lock_wait_s"] = round(lk.waited, 1)
    entry["returncode"] = rc
    if os.path.exists(out):
        with open(out) as f:
            entry["result"] = _slim(piece["part"], json.load(f))
        if piece["part"] == "limits":
            os.replace(out, os.path.join(tmp, "limits.json"))
    else:
        entry["error"] = f"no result (exit {rc})"
    print(f"## {piece['part']} done in {entry['wall_s']} s (exit {rc})", flush=True)
    return entry


# ====================================================================== tables
def _limits(data: dict) -> dict:
    e = next((x for x in data["entries"] if x["part"] == "limits" and "result" in x), None)
    return e["result"]["limits"] if e else {}


def _lim(limits: dict, kind: str) -> float | None:
    x = limits.get(kind)
    return x["gbps"] if x else None


def rows_limits(data: dict) -> list[list]:
    e = next((x for x in data["entries"] if x["part"] == "limits" and "result" in x), None)
    if not e:
        return []
    res = e["result"]
    names = {"memcpy_1t": "memory copy, 1 thread", "memcpy_2t": "memory copy, 2 threads",
             "write_1s": "write + fsync, 1 stream", "write_2s": "write + fsync, 2 streams",
             "read_cold_1s": "read cold, 1 stream", "read_cold_2s": "read cold, 2 streams",
             "read_cached_1s": "read from page cache, 1 stream", "read_cached_2s": "read from page cache, 2 streams"}
    used = {v["variant"]: k for k, v in res["limits"].items()}
    return [[names.get(k, k), R.fmt_summary(v, 1, 2), f"**{used[k]}**" if k in used else ""] for k, v in res["variants"].items()]


def rows_single(data: dict) -> list[list]:
    rows = []
    for e in data["entries"]:
        if e["part"] != "single" or "result" not in e:
            continue
        res = e["result"]
        agg = res["summary"]
        mb = res["state_bytes"] / 1e6
        for op, lim in (("save", "write"), ("load_cold", "read_cold"), ("load_warm", "read_cached")):
            lg = _lim(_limits(data), lim) or agg[op].get("limit_gbps")
            for s in ("torch", "safetensors", "shardpoint"):
                x = agg[op][s]
                g = x["gbps"]["median"] if x["gbps"] else None
                rows.append([f"{mb:.0f} MB", op.replace("_", " "), s, R.fmt_summary(x["seconds"], 1, 3), R.fmt_num(g),
                             R.fmt_pct(R.fraction(g, lg)), R.fmt_ratio(x["vs_anchor"])])
    return rows


SYNC_OPS = (("same.save", "save 4 ranks", "write"), ("same.load_cold", "load same layout, cold", "read_cold"),
            ("same.load_warm", "load same layout, warm", "read_cached"),
            ("reshard.load_cold", "load into FSDP2 x2, cold", "read_cold"),
            ("reshard.load_warm", "load into FSDP2 x2, warm", "read_cached"))


def sync_points(data: dict) -> list[dict]:
    """One point per (size, layout, operation, system) of the sync part."""
    pts = []
    limits = _limits(data)
    for e in data["entries"]:
        if e["part"] != "sync" or "result" not in e:
            continue
        res = e["result"]
        nbytes = res["state_bytes"]
        for key, label, lim in SYNC_OPS:
            row = res["summary"].get(key)
            if not row:
                continue
            for s, name in (("shardpoint", "shardpoint"), ("dcp", "DCP")):
                x = row[s]
                secs = {k: x[k] for k in ("median", "min", "max", "n")}
                g = R.rate(nbytes, secs)
                io = x.get("io_sum_median", {})
                pts.append({"size_mb": nbytes / 1e6, "layout": e["layout"], "op": key, "label": label, "system": name,
                            "seconds": secs, "gbps": g, "limit": lim,
                            "of_limit": R.fraction(g["median"] if g else None, _lim(limits, lim)),
                            "vs_anchor": R.ratio(row["shardpoint"]["median"], row["dcp"]["median"]) if s == "shardpoint" else 1.0,
                            "device_read_over_state": (io.get("read_bytes") / nbytes) if ("load" in key and io.get("read_bytes") is not None) else None,
                            "rchar_over_state": (io.get("rchar") / nbytes) if ("load" in key and io.get("rchar") is not None) else None})
    return pts


def rows_sync(data: dict) -> list[list]:
    return [[f"{p['size_mb']:.0f} MB", LAYOUT_LABEL.get(p["layout"], p["layout"]), p["label"], p["system"],
             R.fmt_summary(p["seconds"], 1, 3), R.fmt_num(p["gbps"]["median"] if p["gbps"] else None),
             R.fmt_pct(p["of_limit"]) + f" {p['limit'].replace('_', ' ')}",
             R.fmt_ratio(p["vs_anchor"]) if p["system"] == "shardpoint" else "1 (anchor)",
             R.fmt_num(p["rchar_over_state"]) if p["rchar_over_state"] is not None else ""]
            for p in sync_points(data)]


def async_points(data: dict) -> list[dict]:
    pts = []
    limits = _limits(data)
    for e in data["entries"]:
        if e["part"] != "async" or "result" not in e:
            continue
        res = e["result"]
        ok = [s for s in res.get("systems", []) if "error" not in s and s["system"] != "none"]
        anchor = next((s for s in ok if s["system"] == "dcp-thread"), None)
        for s in res.get("systems", []):
            if s["system"] == "none":
                continue
            if "error" in s:
                # size from a sibling that finished, so the failed row lines up with its peers
                sib = ok[0] if ok else None
                mb = (sib.get("ckpt_bytes") or sib["state_bytes"]) / 1e6 if sib else None
                lines = s["error"].splitlines()
                sig = next((ln.split(": ", 1)[-1] for ln in lines if "terminated with signal" in ln), None)
                reason = f"{lines[0].split(' failed')[0]}: {sig}" if sig else lines[0]
                pts.append({"size": e["size"], "ckpt_mb": mb, "layout": e["layout"], "system": s["system"],
                            "error": s["error"][-300:], "reason": reason[:80]})
                continue
            nbytes = s.get("ckpt_bytes") or s["state_bytes"]
            stall = s["stall_s"]
            durable = s["durable_s"]
            d_rate = R.rate(nbytes, durable)
            s_rate = R.rate(nbytes, stall)
            pts.append({
                "size": e["size"], "layout": e["layout"], "system": s["system"], "ckpt_mb": nbytes / 1e6,
                "stall_s": stall, "overhead": s["overhead"], "durable_s": durable,
                "stall_vs_anchor": R.ratio(stall["median"], anchor["stall_s"]["median"]) if anchor else None,
                "durable_gbps": d_rate, "durable_of_write": R.fraction(d_rate["median"] if d_rate else None, _lim(limits, "write")),
                # state bytes per second of stall, against a plain copy of the same bytes
                "stall_gbps": s_rate, "stall_of_memcpy": R.fraction(s_rate["median"] if s_rate else None, _lim(limits, "memcpy")),
                "snapshot_s": (s.get("sp_timings_rank0_last") or {}).get("snapshot"),
                "verified": s.get("verified"), "peak_rss_mb": s["peak_rss_with_children_mb"]["max"],
            })
    return pts


def rows_async(data: dict) -> list[list]:
    rows = []
    for p in async_points(data):
        if "error" in p:
            size = f"{p['ckpt_mb']:.0f} MB" if p.get("ckpt_mb") else p["size"]
            rows.append([size, LAYOUT_LABEL.get(p["layout"], p["layout"]), ASYNC_LABEL.get(p["system"], p["system"]),
                         f"failed: {p['reason']}", "", "", "", "", "", ""])
            continue
        rows.append([f"{p['ckpt_mb']:.0f} MB", LAYOUT_LABEL.get(p["layout"], p["layout"]), ASYNC_LABEL.get(p["system"], p["system"]),
                     R.fmt_summary(p["stall_s"], 1000, 1),
                     "1 (anchor)" if p["system"] == "dcp-thread" else R.fmt_ratio(p["stall_vs_anchor"]),
                     R.fmt_pct(p["stall_of_memcpy"]),
                     R.fmt_summary(R.scaled(p["overhead"], 100), 1, 1),
                     R.fmt_summary(p["durable_s"], 1, 2),
                     R.fmt_pct(p["durable_of_write"]),
                     {True: "yes", False: "NO"}.get(p["verified"], "-")])
    return rows


def load_points(data: dict) -> list[dict]:
    pts = []
    limits = _limits(data)
    for e in data["entries"]:
        if e["part"] != "load" or "result" not in e:
            continue
        res = e["result"]
        for r in res.get("loads", []):
            if not r.get("ok"):
                pts.append({"size_mb": res.get("state_mb"), "target": r["target"], "system": r["system"], "error": r.get("error")})
                continue
            anchor = next((x for x in res["loads"] if x["target"] == r["target"] and x["system"] == "dcp" and x.get("ok")), None)
            read = r["storage_bytes_read"]["median"] if "storage_bytes_read" in r else r["rchar_sum"]["median"]
            g = R.rate(r["needed_bytes"], r["wall_s"])
            pts.append({"size_mb": res["state_mb"], "target": r["target"], "system": r["system"], "wall_s": r["wall_s"],
                        "read_mb": read / 1e6, "needed_mb": r["needed_bytes"] / 1e6,
                        "read_over_needed": r.get("read_over_needed"), "read_over_ckpt": r.get("read_over_ckpt"),
                        "gbps": g, "of_read_cold": R.fraction(g["median"] if g else None, _lim(limits, "read_cold" if r.get("cold") else "read_cached")),
                        "cold": r.get("cold"), "vs_anchor": R.ratio(r["wall_s"]["median"], anchor["wall_s"]["median"]) if anchor else None,
                        "bitexact": r.get("bitexact")})
    return pts


TARGET_LABEL = {"fsdp2-4": "FSDP2 x4 (same layout)", "tp-2": "TP x2 (resharding)", "ddp-4": "DDP x4 (replicated)"}


def rows_load(data: dict) -> list[list]:
    rows = []
    for p in load_points(data):
        if "error" in p:
            rows.append([f"{p['size_mb'] or 0:.0f} MB", TARGET_LABEL.get(p["target"], p["target"]), LOAD_LABEL.get(p["system"], p["system"]),
                         "failed", "", "", "", "", "", ""])
            continue
        rows.append([f"{p['size_mb']:.0f} MB", TARGET_LABEL.get(p["target"], p["target"]), LOAD_LABEL.get(p["system"], p["system"]),
                     R.fmt_summary(p["wall_s"], 1, 2), R.fmt_num(p["gbps"]["median"] if p["gbps"] else None),
                     R.fmt_pct(p["of_read_cold"]), f"{p['read_mb']:.0f} / {p['needed_mb']:.0f}",
                     R.fmt_num(p["read_over_needed"], 3), "1 (anchor)" if p["system"] == "dcp" else R.fmt_ratio(p["vs_anchor"]),
                     {True: "yes", False: "NO"}.get(p["bitexact"], "-")])
    return rows


def render(data: dict) -> str:
    """The markdown report: one table per part."""
    out = []
    lim = rows_limits(data)
    if lim:
        out += ["**Machine limits** (`bench/limits.py`), GB/s, median [min, max]; bold: the limit each "
                "result is measured against (the best variant):", "",
                R.markdown_table(["measurement", "GB/s", "limit for"], lim), ""]
    rs = rows_single(data)
    if rs:
        out += ["**Single process** (`bench/bench_single.py`), anchor `torch.save`/`torch.load`:", "",
                R.markdown_table(["state", "operation", "system", "seconds", "GB/s", "of limit", "vs torch"], rs), ""]
    rs = rows_sync(data)
    if rs:
        out += ["**Sync save and load, 4 ranks** (`bench/bench_sync.py`), anchor DCP; GB/s = state bytes / median seconds; "
                "rchar = bytes through read calls / state bytes:", "",
                R.markdown_table(["state", "layout", "operation", "system", "seconds", "GB/s", "of limit", "vs DCP", "rchar / state"], rs), ""]
    rs = rows_async(data)
    if rs:
        out += ["**Async save while training, 4 ranks** (`bench/bench_async.py`), anchor DCP `async_save` (thread executor); "
                "stall of memcpy = time to copy the checkpoint's bytes at the memcpy limit / stall; durable of write = "
                "checkpoint bytes / (call -> durable) against write + fsync:", "",
                R.markdown_table(["checkpoint", "layout", "system", "stall ms", "stall vs DCP thread", "stall of memcpy",
                                  "overhead %", "call -> durable s", "durable of write", "bit-exact"], rs), ""]
    rs = rows_load(data)
    if rs:
        out += ["**Loads from an FSDP2 x4 checkpoint, cold** (`bench/bench_load.py`), anchor DCP; GB/s = bytes the "
                "targets need / median seconds; read = shardpoint's storage-layer count, else /proc rchar (MB):", "",
                R.markdown_table(["state", "target", "system", "seconds", "GB/s", "of read limit", "read / needed MB",
                                  "read / needed", "vs DCP", "bit-exact"], rs), ""]
    return "\n".join(out)


# ====================================================================== plots
def plots(data: dict, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    limits = _limits(data)
    color = {"shardpoint": "tab:green", "DCP": "tab:blue", "torch": "tab:gray", "safetensors": "tab:purple",
             "sp-eager": "tab:green", "sp-lazy": "yellowgreen", "dcp-thread": "tab:blue", "dcp-process": "lightsteelblue",
             "bcp": "tab:orange", "sp-share": "tab:green", "sp-noshare": "yellowgreen", "dcp": "tab:blue"}

    def bars(ax, groups: list[str], series: dict[str, list], title: str, unit: str, log=False):
        n = max(1, len(series))
        w = 0.8 / n
        for j, (name, vals) in enumerate(series.items()):
            xs, med, lo, hi = [], [], [], []
            for i, v in enumerate(vals):
                if v is None:
                    continue
                xs.append(i + (j - (n - 1) / 2) * w)
                med.append(v["median"])
                lo.append(v["median"] - v["min"])
                hi.append(v["max"] - v["median"])
            ax.bar(xs, med, w, yerr=[lo, hi], capsize=2, label=name, color=color.get(name))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        if log:
            ax.set_yscale("log")

    # ---- stall (async)
    pts = [p for p in async_points(data) if "error" not in p]
    if pts:
        def gkey(p):
            return f"{SIZE_LABEL.get(p['size'], p['size'])} {LAYOUT_LABEL.get(p['layout'], p['layout'])}"

        groups = list(dict.fromkeys(gkey(p) for p in pts))
        systems = list(dict.fromkeys(p["system"] for p in pts))
        fig, axes = plt.subplots(1, 2, figsize=(15, 5))
        for ax, key, title, unit, scale, log in ((axes[0], "stall_s", "training stall per checkpoint", "ms (log)", 1000, True),
                                                 (axes[1], "overhead", "step-time overhead of a checkpoint window", "%", 100, False)):
            series = {}
            for s in systems:
                vals = []
                for g in groups:
                    p = next((q for q in pts if q["system"] == s and gkey(q) == g), None)
                    vals.append(R.scaled(p[key], scale) if p else None)
                series[ASYNC_LABEL.get(s, s)] = vals
            for name, s in zip(list(series), systems):
                color[name] = color.get(s)
            bars(ax, groups, series, title, unit, log)
        axes[0].legend(fontsize=8)
        fig.suptitle("Async save while training, 4 ranks on 2 CPU cores (median, bars: min-max)")
        fig.tight_layout()
        path = f"{prefix}_stall.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    # ---- throughput (single + sync)
    sp = sync_points(data)
    single = [e for e in data["entries"] if e["part"] == "single" and "result" in e]
    panels = []
    for e in single:
        res = e["result"]
        ops = [("save", "save", "write"), ("load_cold", "load cold", "read_cold"), ("load_warm", "load warm", "read_cached")]
        series = {s: [res["summary"][op][s]["gbps"] for op, _l, _k in ops] for s in ("torch", "safetensors", "shardpoint")}
        panels.append((f"1 process, {res['state_bytes'] / 1e6:.0f} MB", [l for _o, l, _k in ops], series, [k for *_x, k in ops]))
    for size in dict.fromkeys(round(p["size_mb"]) for p in sp):
        mine = [p for p in sp if round(p["size_mb"]) == size]
        groups = list(dict.fromkeys((p["layout"], p["op"]) for p in mine))
        labels = [f"{LAYOUT_LABEL.get(lay, lay).split(' ')[0]} {next(p['label'] for p in mine if p['op'] == op)}" for lay, op in groups]
        series = {s: [next((p["gbps"] for p in mine if (p["layout"], p["op"]) == g and p["system"] == s), None) for g in groups]
                  for s in ("shardpoint", "DCP")}
        panels.append((f"4 ranks, {size} MB", labels, series, [next(p["limit"] for p in mine if p["op"] == op) for _l, op in groups]))
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(15, 3.6 * len(panels) + 1), squeeze=False)
        for ax, (title, labels, series, lims) in zip(axes[:, 0], panels):
            bars(ax, labels, series, title, "GB/s (state bytes / s)")
            for i, k in enumerate(lims):
                g = _lim(limits, k)
                if g and k != "read_cached":
                    ax.hlines(g, i - 0.45, i + 0.45, colors="red", linestyles="--", lw=1)
            ax.legend(fontsize=7)
        fig.suptitle("Save and load throughput (median, bars: min-max); red dashes: the machine's write + fsync or cold-read limit")
        fig.tight_layout()
        path = f"{prefix}_throughput.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    # ---- bytes read (load)
    lp = [p for p in load_points(data) if "error" not in p]
    if lp:
        groups = list(dict.fromkeys((round(p["size_mb"]), p["target"]) for p in lp))
        systems = list(dict.fromkeys(p["system"] for p in lp))
        fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(groups)), 4.8))
        w = 0.8 / len(systems)
        for j, s in enumerate(systems):
            xs, ys = [], []
            for i, g in enumerate(groups):
                p = next((q for q in lp if (round(q["size_mb"]), q["target"]) == g and q["system"] == s), None)
                if p and p["read_over_needed"] is not None:
                    xs.append(i + (j - (len(systems) - 1) / 2) * w)
                    ys.append(p["read_over_needed"])
            ax.bar(xs, ys, w, label=LOAD_LABEL.get(s, s), color=color.get(s))
        ax.axhline(1.0, color="red", ls="--", lw=1)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{mb} MB -> {TARGET_LABEL.get(t, t)}" for mb, t in groups], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("bytes read / bytes the target needs")
        ax.set_title("Bytes read by a cold load from an FSDP2 x4 checkpoint\n(shardpoint: its storage-layer count; DCP, ByteCheckpoint: /proc rchar)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}_bytes_read.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


# ====================================================================== main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 MB state only, 3 repeats, async and load on FSDP2 only (< 10 min)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)} (default: both; 100mb with --quick)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    ap.add_argument("--json", default=None, help="results (default bench/results/suite.json; suite_quick.json with --quick)")
    ap.add_argument("--plots", default=None, help="PNG prefix (default docs/bench_suite; docs/bench_suite_quick with --quick)")
    ap.add_argument("--merge", default=None, help="start from this suite JSON and replace/add this run's entries")
    ap.add_argument("--report-only", action="store_true", help="run nothing: print the tables and draw the plots of --json")
    ap.add_argument("--lock", default=DEFAULT_LOCK, help="lock file held while each piece runs (default: the shared benchmark lock)")
    ap.add_argument("--no-lock", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per piece")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    jpath = args.json or os.path.join("bench", "results", "suite_quick.json" if args.quick else "suite.json")
    prefix = args.plots or os.path.join("docs", "bench_suite_quick" if args.quick else "bench_suite")

    if args.report_only:
        with open(jpath) as f:
            data = json.load(f)
    else:
        sizes = args.sizes.split(",") if args.sizes else (["100mb"] if args.quick else list(SIZES))
        parts = args.parts.split(",")
        layouts = args.layouts.split(",")
        for name, vals, allowed in (("sizes", sizes, SIZES), ("parts", parts, PARTS), ("layouts", layouts, LAYOUTS)):
            bad = [v for v in vals if v not in allowed]
            if bad:
                ap.error(f"unknown {name}: {bad}")
        pieces = plan(args.quick, sizes, parts, layouts)
        if args.dry_run:
            for p in pieces:
                print(".venv/bin/python " + " ".join(p["args"]))
            return 0
        before = None  # the last recorded results at --json, to print the async call times beside
        if os.path.exists(jpath):
            with open(jpath) as f:
                before = json.load(f)
        data: dict[str, Any] = {"benchmark": "suite", "entries": []}
        if args.merge and os.path.exists(args.merge):
            with open(args.merge) as f:
                data = json.load(f)
        import _common as C

        run = {"command": "bench/suite.py " + " ".join(os.path.basename(a) if os.sep in a else a
                                                       for a in (sys.argv[1:] if argv is None else argv)),
               "machine": C.machine_info(), "git": C.git_rev(), "load_average_start": C.load_average(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        t0 = time.monotonic()
        new = []
        with tempfile.TemporaryDirectory(prefix="sp-bench-suite-") as tmp:
            if "limits" not in parts:  # reuse earlier limits for the fractions where there are some
                old = next((e for e in data["entries"] if e["part"] == "limits" and "result" in e), None)
                if old:
                    C.write_json(os.path.join(tmp, "limits.json"), old["result"])
            for p in pieces:
                e = run_piece(p, tmp, None if args.no_lock else args.lock, args.timeout)
                e["run"] = run["command"]
                new.append(e)
        run["wall_s"] = round(time.monotonic() - t0, 1)
        run["load_average_end"] = C.load_average()
        data["entries"] = R.merge_entries(data["entries"], new)
        data.setdefault("runs", []).append(run)
        C.write_json(jpath, data)
        print(f"\n# suite wall time {run['wall_s']:.0f} s; wrote {jpath}")
        report = R.async_call_report(before, {"entries": new})
        if report:
            print("\n# shardpoint async save, this run against the last recorded (slower figures are not failures):")
            print("\n".join("# " + line for line in report))
    print()
    print(render(data))
    try:
        for p in plots(data, prefix):
            print(f"# wrote {p}")
    except ImportError as e:
        print(f"# no plots: {e} (install the 'tools' extra: matplotlib)")
    failed = [e for e in data["entries"] if "result" not in e]
    return 1 if failed and not args.report_only else 0


if __name__ == "__main__":
    sys.exit(main())
