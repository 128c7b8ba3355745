"""Loading: shardpoint vs PyTorch DCP vs ByteCheckpoint, same layout, resharded and replicated.

One 4-rank FSDP2 TinyGPT + AdamW state (trained a few steps) is saved once by
each system. Then, in one run, each checkpoint is loaded into:

1. ``fsdp2-4``: FSDP2 on 4 ranks (the same layout);
2. ``tp-2``: tensor parallel on 2 ranks (resharding: each rank needs half of
   every row-wise or column-wise weight);
3. ``ddp-4``: DDP on 4 ranks (every rank needs the whole state).

Systems: shardpoint ``sp.load`` with ``share_reads=True`` and ``False`` (and
``sp-nommap``: ``False`` with mapped reads off, the buffered path;
``sp-mmap``: ``False`` with every narrowed span mapped, whatever the page
cache holds; the default maps only spans already in the cache), DCP
``dcp.load`` (with ``get_state_dict``/``set_state_dict``, as its docs do), and
ByteCheckpoint 0.0.2 ``load(fast_loading=True)`` where it supports the layout.
Repeats are interleaved across systems, in orders balanced for the load
that ran just before (a Williams design: over ``n`` repeats of ``n``
systems, ``2n`` when ``n`` is odd, each runs right after each other equally
often; each load records its predecessor in ``after_values``). The page
cache is dropped before every load when the process may (root), so the
numbers are cold reads (``--prime X`` first reads and drops scratch data X
times the checkpoint's size, a diagnostic: ``_common.prime_page_memory``).
A full garbage collection runs
before every load (outside the timing; ``--no-collect`` skips it), so that
no load pays for a collection of the garbage earlier loads, of any system,
left (one costs 0.15 s or more in these processes).

Per load it reports the wall time (slowest rank), bytes read and needed, and
the peak RSS of the ranks. Bytes read come from two sources:

- shardpoint: the storage layer's own counter (``LocalStorage.stats``), and
  ``LoadResult`` (bytes read, needed, received from peers);
- every system, shardpoint included for calibration: ``/proc/self/io`` deltas
  per rank. ``rchar`` counts every byte through ``read``-family calls,
  page-cache hits and socket reads (gloo traffic) included; ``read_bytes``
  counts bytes fetched from the block device, so a page that a second rank
  reads again from the cache is not counted, and readahead is.

Each loaded state is checked bit-exact against the saved one (xxh3 of every
unsharded tensor) on the first repeat.

Usage::

    python bench/bench_load.py --quick
    python bench/bench_load.py --json bench-load.json --plot docs/bench_load.png
    python bench/bench_load.py --size 1.5gb --repeats 3      # a suite state size: 100mb or 1.5gb
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import report as R  # noqa: E402

TARGETS = {"fsdp2-4": ("fsdp2", 4), "tp-2": ("tp", 2), "ddp-4": ("ddp", 4)}
SYSTEMS = {
    "sp-share": "shardpoint sp.load(share_reads=True)",
    "sp-noshare": "shardpoint sp.load(share_reads=False)",
    "sp-noverify": "shardpoint sp.load(share_reads=False, verify=False) (resharding target only: shows the byte ranges without checksum blocks)",
    "sp-nommap": "shardpoint sp.load(share_reads=False) from LocalStorage(mmap_reads=False): every narrowed span read into a buffer",
    "sp-mmap": "shardpoint sp.load(share_reads=False) from LocalStorage(mmap_reads=True): every narrowed span mapped, cached or not",
    "dcp": "DCP get_state_dict + dcp.load + set_state_dict",
    "bcp": "ByteCheckpoint 0.0.2 load(framework='fsdp2', fast_loading=True)",
}


# ====================================================================== rank side
def save_job(rank: int, world: int, cfg: dict, root: str, systems: list[str], steps: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build, train_step

    c = GPTConfig(**cfg)
    model, opt = build("fsdp2", c, seed=0, lr=1e-4)
    for i in range(steps):
        train_step(model, opt, i, c)
    out = {"local_state_bytes": C.local_state_bytes(model, opt), "sizes": {}, "save_s": {}}
    ref = C.full_hashes(model, opt)
    if rank == 0:
        out["ref"] = ref
    for s in sorted({"sp" if x.startswith("sp") else x for x in systems}):
        path = os.path.join(root, s)
        dist.barrier()
        t = time.monotonic()
        if s == "sp":
            sp.save(path, {"model": model, "optimizer": opt})
        elif s == "dcp":
            dcp.save(C.dcp_state(model, opt), checkpoint_id=path)
        elif s == "bcp":
            import bytecheckpoint as bcp

            C.bcp_loopback()
            bcp.save(path, {"model": model, "optimizer": opt}, framework="fsdp2", fast_saving=False)
        dist.barrier()
        out["save_s"][s] = time.monotonic() - t
        if rank == 0:
            out["sizes"][s] = C.dir_bytes(path)
    return out


def _scramble(model, opt) -> None:
    """Overwrite the target state so a load that silently skips something cannot pass the check."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            C._local(p).fill_(0.5)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    C._local(v).fill_(0)


def load_job(rank: int, world: int, target: str, cfg: dict, root: str, systems: list[str], repeats: int,
             ref: dict, cold: bool, verify: bool, collect: bool = True, scratch: str | None = None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardpoint as sp
    from shardpoint.storage import LocalStorage
    from shardpoint.testing import GPTConfig, build

    layout, _w = TARGETS[target]
    c = GPTConfig(**cfg)
    model, opt = build(layout, c, seed=7, lr=1e-4)
    if "bcp" in systems:
        C.bcp_loopback()
    hwm = C.PeakRss()  # the kernel's high-water mark: no sampling thread beside the loads
    sampler = None if hwm.available else C.RssSampler(interval=0.005).start()
    runs = []
    prev = None
    for rep in range(repeats):
        # A cold load's time depends on what ran just before it (on the benchmark VM, on how much
        # recently used memory the last load freed), so every system follows every other equally often.
        for pos, s in enumerate(systems[j] for j in R.carryover_order(len(systems), rep)):
            _scramble(model, opt)
            if collect:
                gc.collect()  # no load pays for a full collection of the garbage its predecessors left
            dist.barrier()
            if cold and rank == 0:
                dropped = C.prime_page_memory(scratch) if scratch else C.drop_caches()
            else:
                dropped = False
            dist.barrier()
            io0 = C.proc_io()
            if sampler is not None:
                sampler.reset()
            else:
                hwm.reset()
            rss0 = sampler.rss() if sampler is not None else hwm.rss()
            run = {"system": s, "rep": rep, "position": pos, "after": prev, "dropped_cache": dropped}
            prev = s
            st = None
            t = time.monotonic()
            try:
                if s.startswith("sp-"):
                    st = LocalStorage(os.path.join(root, "sp"), mmap_reads={"sp-nommap": False, "sp-mmap": True}.get(s, "auto"))
                    rep_ = sp.LoadResult()
                    sp.load(st, {"model": model, "optimizer": opt}, share_reads=(s == "sp-share"),
                            verify=(s != "sp-noverify"), report=rep_)
                    run.update(storage_bytes_read=st.stats.bytes_read, bytes_read=rep_.bytes_read,
                               bytes_needed=rep_.bytes_needed, bytes_received=rep_.bytes_received,
                               timings={k: round(v, 4) for k, v in rep_.timings.items()})
                elif s == "dcp":
                    sd = C.dcp_state(model, opt)
                    dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
                    C.dcp_apply(model, opt, sd)
                elif s == "bcp":
                    import bytecheckpoint as bcp

                    m = model.module if layout == "ddp" else model
                    bcp.load(os.path.join(root, "bcp"), {"model": m, "optimizer": opt}, framework="fsdp2", fast_loading=True)
                run["ok"] = True
            except Exception as e:  # noqa: BLE001
                run["ok"] = False
                run["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            run["wall_s"] = time.monotonic() - t
            if st is not None:
                # Unmap now: pages mapped by a live storage object survive the next drop of the page
                # cache, and the next system's "cold" load would find them (an unclosed one did).
                st.close()
                st = None
            io1 = C.proc_io()
            dist.barrier()
            run["rchar"] = io1.get("rchar", 0) - io0.get("rchar", 0)
            run["read_bytes"] = io1.get("read_bytes", 0) - io0.get("read_bytes", 0)
            peak = sampler.peak if sampler is not None else hwm.peak()
            run["peak_rss"] = peak
            run["peak_rss_over_start"] = peak - rss0
            run["rss_start"] = rss0
            flag = torch.tensor([1 if run["ok"] else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # check only when every rank loaded
            if verify and rep == 0 and int(flag) == 1:
                bad = C.diff_hashes(ref, C.full_hashes(model, opt))
                run["bitexact"] = not bad
                run["differs"] = bad[:5]
                run["n_differs"] = len(bad)
            runs.append(run)
    if sampler is not None:
        sampler.stop()
    return {"rank": rank, "target": target, "needed_local": C.local_state_bytes(model, opt), "runs": runs}


# ====================================================================== parent side
def aggregate(target: str, ranks: list[dict], ckpt_sizes: dict) -> list[dict]:
    out = []
    needed = sum(r["needed_local"] for r in ranks)
    systems = list(dict.fromkeys(run["system"] for run in ranks[0]["runs"]))
    for s in systems:
        reps = sorted({run["rep"] for run in ranks[0]["runs"] if run["system"] == s})
        per = []  # one entry per repeat, summed or maxed over ranks
        for rep in reps:
            rr = [next(x for x in r["runs"] if x["system"] == s and x["rep"] == rep) for r in ranks]
            e = {
                "ok": all(x["ok"] for x in rr),
                "wall_s": max(x["wall_s"] for x in rr),
                "rchar": sum(x["rchar"] for x in rr),
                "read_bytes": sum(x["read_bytes"] for x in rr),
                "peak_rss": max(x["peak_rss"] for x in rr),
                "peak_rss_over_start": max(x["peak_rss_over_start"] for x in rr),
                "dropped_cache": rr[0]["dropped_cache"],
                "after": rr[0]["after"],
                "error": next((x["error"] for x in rr if not x["ok"]), None),
            }
            if "storage_bytes_read" in rr[0]:
                for k in ("storage_bytes_read", "bytes_read", "bytes_needed", "bytes_received"):
                    e[k] = sum(x[k] for x in rr)
                e["storage_bytes_read_per_rank"] = [x["storage_bytes_read"] for x in rr]
                e["timings_rank0"] = rr[0]["timings"]
                e["timings_slowest"] = max(rr, key=lambda x: x["wall_s"])["timings"]
            if "bitexact" in rr[0]:
                e["bitexact"] = all(x.get("bitexact") for x in rr)
                e["differs"] = rr[0].get("differs")
            per.append(e)
        good = [e for e in per if e["ok"]]
        sysname = "sp" if s.startswith("sp") else s
        agg = {
            "target": target,
            "system": s,
            "description": SYSTEMS[s],
            "ok": bool(good) and len(good) == len(per),
            "error": next((e["error"] for e in per if e["error"]), None),
            "wall_s": C.summary(e["wall_s"] for e in good),
            # Split by what ran just before: on the benchmark VM a cold load is faster right after a
            # load of the same system (docs/benchmarks.md, "The resharding load").
            "wall_s_after_self": C.summary(e["wall_s"] for e in good if e["after"] == s),
            "wall_s_after_other": C.summary(e["wall_s"] for e in good if e["after"] not in (None, s)),
            "wall_s_values": [round(e["wall_s"], 4) for e in per],
            "after_values": [e["after"] for e in per],  # the system whose load ran just before each
            "rchar_sum": C.summary(e["rchar"] for e in good),
            "read_bytes_sum": C.summary(e["read_bytes"] for e in good),
            "peak_rss_mb": C.summary(e["peak_rss"] / 2**20 for e in good),
            "peak_rss_over_start_mb": C.summary(e["peak_rss_over_start"] / 2**20 for e in good),
            "needed_bytes": needed,
            "ckpt_bytes": ckpt_sizes.get(sysname),
            "bitexact": next((e.get("bitexact") for e in per if "bitexact" in e), None),
            "differs": next((e.get("differs") for e in per if e.get("differs")), None),
            "cold": all(e["dropped_cache"] for e in per),
            "repeats": len(per),
        }
        if good and "storage_bytes_read" in good[0]:
            agg["storage_bytes_read"] = C.summary(e["storage_bytes_read"] for e in good)
            agg["storage_bytes_read_per_rank"] = good[0]["storage_bytes_read_per_rank"]
            agg["loadresult_bytes_read"] = good[0]["bytes_read"]
            agg["loadresult_bytes_needed"] = good[0]["bytes_needed"]
            agg["loadresult_bytes_received"] = good[0]["bytes_received"]
            agg["timings_rank0"] = good[0]["timings_rank0"]
            agg["timings_slowest_rank"] = [e["timings_slowest"] for e in good]
        # The bytes this system read from storage: the storage layer's count where there is one.
        read = agg["storage_bytes_read"]["median"] if "storage_bytes_read" in agg else agg["rchar_sum"]["median"]
        if read is not None:
            agg["read_over_needed"] = read / needed
            if agg["ckpt_bytes"]:
                agg["read_over_ckpt"] = read / agg["ckpt_bytes"]
        out.append(agg)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [t for t in TARGETS if any(r["target"] == t for r in results["loads"])]
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results["loads"])]
    colors = {"sp-share": "tab:green", "sp-noshare": "yellowgreen", "sp-noverify": "darkseagreen", "sp-nommap": "olive", "sp-mmap": "darkkhaki", "dcp": "tab:blue", "bcp": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    width = 0.8 / max(1, len(systems))
    for j, s in enumerate(systems):
        xs, wall, lo, hi, rb, rss = [], [], [], [], [], []
        for i, t in enumerate(targets):
            r = next((x for x in results["loads"] if x["target"] == t and x["system"] == s and x["ok"]), None)
            if r is None:
                continue
            xs.append(i + (j - (len(systems) - 1) / 2) * width)
            w = r["wall_s"]
            wall.append(w["median"])
            lo.append(w["median"] - w["min"])
            hi.append(w["max"] - w["median"])
            rb.append(r.get("read_over_needed") or 0)
            rss.append(r["peak_rss_over_start_mb"]["median"])
        axes[0].bar(xs, wall, width, yerr=[lo, hi], capsize=3, label=s, color=colors.get(s))
        axes[1].bar(xs, rb, width, label=s, color=colors.get(s))
        axes[2].bar(xs, rss, width, label=s, color=colors.get(s))
    for ax, title, unit in ((axes[0], "load wall time (cold cache)", "s"),
                            (axes[1], "bytes read / bytes the target needs", "ratio"),
                            (axes[2], "peak RSS growth during load (max rank)", "MiB")):
        ax.set_xticks(range(len(targets)))
        ax.set_xticklabels(["FSDP2 4->4", "FSDP2 4 -> TP 2", "-> DDP 4"][: len(targets)] if targets == list(TARGETS)[: len(targets)] else targets)
        ax.set_title(title)
        ax.set_ylabel(unit)
    axes[1].axhline(1.05, color="red", ls="--", lw=1)
    axes[0].legend()
    fig.suptitle(f"{results['state_mb']:.0f} MB FSDP2 checkpoint (TinyGPT + AdamW), CPU/gloo, load avg {results['load_average_start'][0]:.2f}; "
                 "shardpoint bytes: storage-layer count; DCP/ByteCheckpoint: sum of /proc/self/io rchar")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller state, one repeat (< 3 min)")
    ap.add_argument("--systems", default=None, help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    ap.add_argument("--size", default=None, help="a suite state size (100mb, 1.5gb): sets vocab, dim, heads, layers")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache between loads")
    ap.add_argument("--prime", type=float, default=0.0, metavar="X",
                    help="before each cold load, read and drop scratch data X times the checkpoint's size "
                         "(a diagnostic for VMs whose balloon reports free pages; see _common.prime_page_memory)")
    ap.add_argument("--root", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--no-collect", action="store_true", help="no full garbage collection before each load")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=1200, help="give up waiting for a quiet machine after this many seconds")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    for a in ("json", "plot", "root"):
        if getattr(args, a):
            setattr(args, a, os.path.abspath(getattr(args, a)))
    C.setup_env()
    from shardpoint.testing import LaunchError, launch

    q = args.quick
    sized = C.size_cfg(args.size) if args.size else {}
    args.dim = args.dim or sized.get("dim") or (384 if q else 768)
    args.layers = args.layers or sized.get("layers") or (4 if q else 5)
    args.repeats = args.repeats or (1 if q else 3)
    systems = args.systems.split(",") if args.systems else list(SYSTEMS)
    targets = args.targets.split(",")
    bcp_status = C.bytecheckpoint_status()
    if "bcp" in systems and not bcp_status["available"]:
        print(f"# ByteCheckpoint unavailable, skipped: {bcp_status['reason']}")
        systems.remove("bcp")
    cfg = {"vocab": sized.get("vocab") or (1024 if q else 2048), "dim": args.dim, "heads": args.dim // 64, "layers": args.layers, "seq": 16}
    quiet = C.wait_quiet(args.wait_quiet, args.wait_max) if args.wait_quiet else {"load_average_at_start": C.load_average()}
    root = args.root or tempfile.mkdtemp(prefix="sp-bench-load-")
    os.makedirs(root, exist_ok=True)
    results = {
        "benchmark": "load",
        "command": "python bench/bench_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"model": cfg, "size": args.size, "saved_from": "fsdp2 x4", "optimizer": "AdamW", "repeats": args.repeats, "cold": not args.warm,
                   "gc_collect_before_each_load": not args.no_collect, "system_order": "Williams design: each system right after each other equally often",
                   "peak_rss": "kernel high-water mark (VmHWM, reset through /proc/self/clear_refs) where allowed, else a 5 ms sampler"},
        "machine": C.machine_info(),
        "git": C.git_rev(),
        "bytecheckpoint": bcp_status,
        "load_average_start": quiet["load_average_at_start"],
        "loads": [],
    }
    print(f"# TinyGPT {cfg} + AdamW saved from FSDP2 x4; {args.repeats} repeat(s) (system order balanced for the one before), "
          f"{'warm' if args.warm else ('cold (page cache dropped before each load)' if not args.prime else f'cold (page cache primed with {args.prime}x the checkpoint in scratch data, then dropped, before each load)')}; load average {results['load_average_start'][0]:.2f}", flush=True)
    try:
        t = time.monotonic()
        saved = launch(4, "bench_load:save_job", {"cfg": cfg, "root": root, "systems": systems, "steps": 2}, timeout=args.timeout)
        results["ckpt_bytes"] = saved[0]["sizes"]
        results["save_s"] = saved[0]["save_s"]
        results["state_mb"] = sum(r["local_state_bytes"] for r in saved) / 1e6
        ref = saved[0]["ref"]
        print(f"# saved {results['state_mb']:.0f} MB of state: " + ", ".join(
            f"{k} {v / 1e6:.0f} MB in {saved[0]['save_s'][k]:.1f} s" for k, v in results["ckpt_bytes"].items())
            + f" ({time.monotonic() - t:.0f} s)", flush=True)
        scratch = None
        if not args.warm and args.prime > 0:
            scratch = C.write_scratch(os.path.join(root, "prime.scratch"), int(args.prime * max(results["ckpt_bytes"].values())))
        results["config"]["prime_factor"] = args.prime if scratch else 0
        print(f"{'target':8s} {'system':10s} {'wall s (median [min,max])':>26s} {'read/needed':>11s} {'read/ckpt':>9s} "
              f"{'rchar/needed':>12s} {'peak +MiB':>9s}  bitexact", flush=True)
        for target in targets:
            layout, world = TARGETS[target]
            mine = [s for s in systems if s != "sp-noverify" or target == "tp-2"]
            groups = [[s for s in mine if s != "bcp"]] + ([["bcp"]] if "bcp" in mine else [])
            for group in groups:  # ByteCheckpoint in its own job: a failure there cannot take the others down
                if not group:
                    continue
                t = time.monotonic()
                try:
                    ranks = launch(world, "bench_load:load_job", {
                        "target": target, "cfg": cfg, "root": root, "systems": group, "repeats": args.repeats,
                        "ref": ref, "cold": not args.warm, "verify": not args.no_verify, "collect": not args.no_collect,
                        "scratch": scratch,
                    }, timeout=args.timeout)
                except LaunchError as e:
                    for s in group:
                        results["loads"].append({"target": target, "system": s, "ok": False, "error": C.failure(str(e))})
                    print(f"{target:8s} {','.join(group)} FAILED: {str(e)[:1500]}", flush=True)
                    continue
                for agg in aggregate(target, ranks, results["ckpt_bytes"]):
                    agg["job_s"] = round(time.monotonic() - t, 1)
                    results["loads"].append(agg)
                    if not agg["ok"]:
                        print(f"{target:8s} {agg['system']:10s} not supported / failed: {agg['error']}", flush=True)
                        continue
                    rn = agg.get("read_over_needed")
                    ro = agg.get("read_over_ckpt")
                    print(f"{target:8s} {agg['system']:10s} {C.fmt(agg['wall_s'], 1, 2):>26s} {rn or 0:11.3f} {ro or 0:9.3f} "
                          f"{agg['rchar_sum']['median'] / agg['needed_bytes']:12.3f} {agg['peak_rss_over_start_mb']['median']:9.0f}  "
                          f"{agg['bitexact']}", flush=True)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    results["load_average_end"] = C.load_average()

    def find(t, s):
        return next((r for r in results["loads"] if r["target"] == t and r["system"] == s and r.get("ok")), None)

    goals = {}
    sp_t, dcp_t = find("tp-2", "sp-share") or find("tp-2", "sp-noshare"), find("tp-2", "dcp")
    if sp_t and dcp_t:
        best = min((r for r in (find("tp-2", "sp-share"), find("tp-2", "sp-noshare")) if r), key=lambda r: r["wall_s"]["median"])
        goals["resharding_speedup_vs_dcp"] = dcp_t["wall_s"]["median"] / best["wall_s"]["median"]
        goals["resharding_speedup_vs_dcp_system"] = best["system"]
        goals["resharding_2x_faster"] = goals["resharding_speedup_vs_dcp"] >= 2
        a, b = dcp_t["wall_s_after_self"]["median"], best["wall_s_after_self"]["median"]
        if a and b:  # each system's loads that followed a load of the same system
            goals["resharding_speedup_vs_dcp_after_self"] = a / b
    for t in ("fsdp2-4", "tp-2"):
        for s in ("sp-share", "sp-noshare"):
            r = find(t, s)
            if r and r.get("read_over_needed") is not None:
                goals[f"read_over_needed[{t},{s}]"] = r["read_over_needed"]
    r = find("ddp-4", "sp-share")
    if r and r.get("read_over_ckpt") is not None:
        goals["replicated_read_over_ckpt"] = r["read_over_ckpt"]
        goals["replicated_about_1x"] = r["read_over_ckpt"] <= 1.1
    results["goals"] = goals
    print(f"# goals: {goals}")
    print(f"# load average at end {results['load_average_end'][0]:.2f}")
    if args.json:
        C.write_json(args.json, results)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"# wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
