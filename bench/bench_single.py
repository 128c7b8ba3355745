"""Single process: shardpoint vs plain ``torch.save``/``torch.load`` vs safetensors.

One process holds a TinyGPT and its AdamW after one training step (so
``exp_avg``, ``exp_avg_sq`` and ``step`` exist). Each system saves that state
and loads it back into a freshly built model and a never-stepped AdamW:

- **torch** (the anchor): ``torch.save({"model": m.state_dict(), "optimizer":
  opt.state_dict()}, f)`` then ``fsync``; ``torch.load(f, weights_only=True)``
  then ``m.load_state_dict`` and ``opt.load_state_dict``;
- **safetensors**: ``safetensors.torch.save_file`` of the flattened model and
  optimizer tensors (the optimizer's param groups as JSON metadata) then
  ``fsync``; ``load_file``, then the same two ``load_state_dict`` calls (the
  optimizer tensors cloned first: ``load_file`` maps the file, and the optimizer
  would otherwise keep the mappings and fault the pages in at its first step);
- **shardpoint**: ``sp.save(path, {"model": m, "optimizer": opt})`` (which
  fsyncs its files) and ``sp.load`` into the fresh pair.

Loads run cold (page cache dropped before, when root) and then warm. Every
load is checked bit-exact (xxh3 of every model and optimizer tensor against
the state that was saved). Systems run in orders balanced for the one before (a Williams design:
each first in turn, and each right after each other equally often);
times are median [min, max] over the repeats. Throughputs are also shown as a
fraction of the machine's limits (``bench/limits.py``): saves against
sequential write + fsync, cold loads against cold sequential reads, warm
loads against reads from the page cache.

    .venv/bin/python bench/bench_single.py                      # 100mb, 5 repeats
    .venv/bin/python bench/bench_single.py --size 1.5gb --repeats 3 --limits limits.json --json single.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import report as R  # noqa: E402
import limits as L  # noqa: E402

SYSTEMS = ("torch", "safetensors", "shardpoint")
ANCHOR = "torch"
DESCRIPTION = {
    "torch": "torch.save / torch.load(weights_only=True) + load_state_dict",
    "safetensors": "safetensors.torch.save_file / load_file + load_state_dict",
    "shardpoint": "sp.save / sp.load",
}


def _flat(model, opt) -> tuple[dict, dict]:
    """safetensors needs one flat dict of tensors: model.<name> and opt.<index>.<key>."""
    sd = opt.state_dict()
    flat = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    other: dict[str, dict] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if hasattr(v, "detach"):
                flat[f"opt.{idx}.{k}"] = v.contiguous()
            else:
                other.setdefault(str(idx), {})[k] = v
    meta = {"param_groups": json.dumps(sd["param_groups"]), "other_state": json.dumps(other)}
    return flat, meta


def _unflat(flat: dict, meta: dict) -> tuple[dict, dict]:
    msd = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    state: dict[int, dict] = {}
    for k, v in flat.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    for idx, st in json.loads(meta["other_state"]).items():
        state.setdefault(int(idx), {}).update(st)
    return msd, {"state": state, "param_groups": json.loads(meta["param_groups"])}


def save_with(system: str, model, opt, path: str) -> None:
    import torch

    if system == "torch":
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    elif system == "safetensors":
        from safetensors.torch import save_file

        flat, meta = _flat(model, opt)
        save_file(flat, path, metadata=meta)
        from shardpoint.storage.local import fsync_path

        fsync_path(path)
    else:
        import shardpoint as sp

        sp.save(path, {"model": model, "optimizer": opt})


def load_with(system: str, model, opt, path: str) -> None:
    import torch

    if system == "torch":
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    elif system == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, "pt") as f:
            meta = f.metadata()
        msd, osd = _unflat(load_file(path), meta)
        model.load_state_dict(msd)  # copies into the parameters
        # load_file returns tensors that map the file (copy-on-write): the optimizer would keep
        # those mappings and fault the pages in at its first step. Clone them, so that the load
        # ends with the state in the process's memory, as the other systems' loads do.
        for st in osd["state"].values():
            for k, v in st.items():
                if hasattr(v, "detach"):
                    st[k] = v.clone()
        opt.load_state_dict(osd)
    else:
        import shardpoint as sp

        sp.load(path, {"model": model, "optimizer": opt})


def _hashes(model, opt) -> dict[str, str]:
    return C.local_hashes(model, opt)


def run(cfg: dict, repeats: int, root: str, drop: bool, log=print) -> dict:
    import torch

    from shardpoint.testing import GPTConfig, build, train_step

    c = GPTConfig(**cfg)
    model, opt = build("single", c, seed=0)
    train_step(model, opt, 0, c)
    ref = _hashes(model, opt)
    state_bytes = C.local_state_bytes(model, opt)
    rounds = []
    for i in range(repeats):
        order = [SYSTEMS[j] for j in R.carryover_order(len(SYSTEMS), i)]
        rnd: dict[str, Any] = {"order": list(order)}
        for s in order:
            path = os.path.join(root, f"{s}-{i}")
            gc.collect()
            t = time.perf_counter()
            save_with(s, model, opt, path)
            r: dict[str, Any] = {"save": time.perf_counter() - t, "disk_bytes": C.dir_bytes(path) if os.path.isdir(path) else os.path.getsize(path)}
            for kind in ("cold", "warm"):
                m2, o2 = build("single", c, seed=1234)
                gc.collect()
                dropped = drop and kind == "cold" and C.drop_caches()
                io0 = C.proc_io()
                t = time.perf_counter()
                load_with(s, m2, o2, path)
                r[f"load_{kind}"] = time.perf_counter() - t
                io1 = C.proc_io()
                r[f"load_{kind}_io"] = {k: io1.get(k, 0) - io0.get(k, 0) for k in ("rchar", "read_bytes")}
                r[f"load_{kind}_cache"] = "dropped" if dropped else "warm"
                bad = C.diff_hashes(ref, _hashes(m2, o2))
                if bad:
                    raise AssertionError(f"{s} {kind} load is NOT bit-exact in {len(bad)} tensors, e.g. {bad[:5]}")
                del m2, o2
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            rnd[s] = r
        rounds.append(rnd)
        log(f"# repeat {i + 1}/{repeats}: " + ", ".join(
            f"{s} save {rnd[s]['save']:.2f}s load cold {rnd[s]['load_cold']:.2f}s warm {rnd[s]['load_warm']:.2f}s" for s in SYSTEMS), flush=True)
    del model, opt
    return {"state_bytes": state_bytes, "tensors": len(ref), "rounds": rounds, "torch_threads": torch.get_num_threads()}


OPS = (("save", "write"), ("load_cold", "read_cold"), ("load_warm", "read_cached"))


def aggregate(res: dict, limits: dict | None) -> dict:
    """Per operation and system: seconds, GB/s, fraction of the limit, ratio to torch."""
    out: dict[str, Any] = {}
    nbytes = res["state_bytes"]
    for op, lim in OPS:
        row: dict[str, Any] = {"limit": lim, "limit_gbps": L.limit_gbps(limits, lim)}
        for s in SYSTEMS:
            secs = R.pooled([r[s][op] for r in res["rounds"]])
            g = R.rate(nbytes, secs)
            row[s] = {"seconds": secs, "gbps": g,
                      "of_limit": R.fraction(g["median"] if g else None, row["limit_gbps"])}
            if op != "save":
                row[s]["read_bytes"] = R.summary(r[s][f"{op}_io"]["read_bytes"] for r in res["rounds"])["median"]
                row[s]["rchar"] = R.summary(r[s][f"{op}_io"]["rchar"] for r in res["rounds"])["median"]
        for s in SYSTEMS:
            row[s]["vs_anchor"] = R.ratio(row[s]["seconds"]["median"], row[ANCHOR]["seconds"]["median"])
        out[op] = row
    out["disk_bytes"] = {s: res["rounds"][-1][s]["disk_bytes"] for s in SYSTEMS}
    return out


def print_report(result: dict) -> None:
    agg = result["summary"]
    print(f"\nSingle process, TinyGPT {result['config']['model']} + AdamW after 1 step: {result['tensors']} tensors, "
          f"{result['state_bytes'] / 1e6:.1f} MB; {result['config']['repeats']} repeats; anchor: torch.save/torch.load; "
          f"cold loads: page cache {'dropped' if result['drop_caches'] else 'NOT dropped'}")
    rows = []
    for op, lim in OPS:
        row = agg[op]
        for s in SYSTEMS:
            x = row[s]
            rows.append([op.replace("_", " "), s, R.fmt_summary(x["seconds"], 1, 3), R.fmt_num(x["gbps"]["median"] if x["gbps"] else None),
                         R.fmt_pct(x["of_limit"]) + f" of {lim}", R.fmt_ratio(x["vs_anchor"])])
    print(R.markdown_table(["operation", "system", "seconds", "GB/s", "of the machine's limit", "vs torch"], rows))
    print("On disk: " + ", ".join(f"{s} {b / 1e6:.1f} MB" for s, b in agg["disk_bytes"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100mb", help=f"state size: {', '.join(C.SIZES)} (default 100mb)")
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --quick)")
    ap.add_argument("--limits", default=None, help="a bench/limits.py JSON for the fractions (default: measure 512 MiB now)")
    ap.add_argument("--no-limits", action="store_true", help="no fractions of the machine's limits")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--dir", default=None, help="parent folder of the checkpoints (default: the temp dir, if on disk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    C.setup_env()
    cfg = C.size_cfg(args.size)
    repeats = args.repeats or (3 if args.quick else 5)
    limits = None if args.no_limits else (L.load(args.limits) or L.measure(512 << 20, 3))
    drop = not args.no_drop_caches and C.drop_caches()
    root = L.disk_dir(args.dir)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "single",
        "command": "bench/bench_single.py " + " ".join(os.path.basename(a) if os.sep in a else a
                                                       for a in (sys.argv[1:] if argv is None else argv)),
        "machine": C.machine_info(),
        "git": C.git_rev(),
        "anchor": ANCHOR,
        "systems": DESCRIPTION,
        "drop_caches": drop,
        "load_average_start": C.load_average(),
        "config": {"size": args.size, "model": cfg, "repeats": repeats, "optimizer": "AdamW(lr=1e-2)"},
        "limits": limits["limits"] if limits else None,
    }
    try:
        res = run(cfg, repeats, root, drop)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result.update(state_bytes=res["state_bytes"], tensors=res["tensors"], raw=res["rounds"], torch_threads=res["torch_threads"])
    result["summary"] = aggregate(res, limits)
    result["load_average_end"] = C.load_average()
    result["wall_seconds"] = time.perf_counter() - t0
    print_report(result)
    print(f"\nTotal wall time {result['wall_seconds']:.0f} s")
    if args.json:
        C.write_json(args.json, result)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
