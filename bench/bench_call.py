"""The warm ``AsyncSaver.save`` call on FSDP2 ranks against the same call in one process on plain tensors.

The call of an asynchronous save is what training waits for. Its work
should grow with the number of tensors at a small constant, and sharding
should add little: the same state held by FSDP2 ranks as DTensors should
cost each rank about what the whole state costs one process holding plain
tensors, where the per-tensor work is the same and only the bytes differ.

Both runs build the same TinyGPT with AdamW (``--dim``, ``--layers``), take
one training step, then make ``--saves`` saves, each after a training step
and a barrier; the first two are the warm-up (the first builds the plan, the
second the kept copy order). Printed per mode: the median and min of the
warm calls on the slowest rank, on ``--world`` FSDP2 ranks and in one
process, their ratio, and the goal (the ranks' call within 3x the one
process's, plus 5 ms), and the median CPU time the training thread spent in
the call on each rank: where the ranks share fewer cores than they are, the
call's wall time exceeds its CPU time. Lazy calls leave the copy to a
worker; eager calls include the copy of the state's bytes. As under a
retention policy, only the :data:`KEEP` latest checkpoints stay on disk: a
run that kept them all would fill the page cache with old checkpoints and
time the kernel's reclaim inside later calls.

    python bench/bench_call.py                       # 2 FSDP2 ranks, lazy and eager
    python bench/bench_call.py --world 4 --modes lazy --json call.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GOAL_FACTOR, GOAL_PLUS_MS = 3.0, 5.0
KEEP = 2


def calls_job(rank: int, world: int, root: str, layout: str, mode: str, saves: int, dim: int, layers: int) -> dict:
    """On each rank: the seconds of every ``AsyncSaver.save`` call (the first two are warm-up)."""
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build, train_step

    cfg = GPTConfig(vocab=1024, dim=dim, heads=4, layers=layers, seq=16)
    model, opt = build(layout, cfg, seed=0)
    train_step(model, opt, 0, cfg)
    state = {"model": model, "optimizer": opt}
    saver = sp.AsyncSaver()
    calls, cpu = [], []
    path = lambda i: os.path.join(root, f"{layout}_{mode}_{i}")  # noqa: E731
    try:
        for i in range(saves):
            train_step(model, opt, i + 1, cfg)
            saver.wait()
            if rank == 0 and i >= KEEP:  # every rank waited for save i - KEEP before the last barrier
                shutil.rmtree(path(i - KEEP), ignore_errors=True)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            handle = saver.save(path(i), state, mode=mode)
            calls.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            handle.fence()
        saver.wait()
    finally:
        saver.close()
    moments = sum(sum(1 for v in st.values() if hasattr(v, "shape") and v.dim() > 0) for st in opt.state.values())
    return {"calls": calls, "cpu": cpu, "tensors": len(list(model.parameters())) + moments}


def measure(world: int, layout: str, mode: str, args: argparse.Namespace) -> dict:
    """Median and min of the warm calls of the slowest rank, in milliseconds."""
    from shardpoint.testing.launcher import launch

    with tempfile.TemporaryDirectory() as root:
        ranks = launch(world, "bench_call:calls_job", {"root": root, "layout": layout, "mode": mode, "saves": args.saves,
                                                         "dim": args.dim, "layers": args.layers}, timeout=args.timeout)
    warm = [max(r["calls"][i] for r in ranks) for i in range(2, args.saves)]
    cpu = [statistics.median(r["cpu"][2:]) * 1e3 for r in ranks]
    return {"median_ms": statistics.median(warm) * 1e3, "min_ms": min(warm) * 1e3, "tensors": ranks[0]["tensors"],
            "cpu_ms_per_rank": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="FSDP2 ranks (default 2)")
    p.add_argument("--modes", default="lazy,eager")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=12, help="saves per run, the first two warm-up")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C

    C.setup_env()  # the ranks import this file as bench_call
    out = {"benchmark": "bench_call", "command": " ".join(sys.argv), "world": args.world, "modes": {}}
    for mode in args.modes.split(","):
        one = measure(1, "single", mode, args)
        ranks = measure(args.world, "fsdp2", mode, args)
        goal = GOAL_FACTOR * one["median_ms"] + GOAL_PLUS_MS
        out["modes"][mode] = {"one_process": one, "fsdp2": ranks, "ratio": ranks["median_ms"] / one["median_ms"],
                              "goal_ms": goal, "met": ranks["median_ms"] <= goal}
        print(f"{mode:6s} one process {one['median_ms']:6.2f} ms [min {one['min_ms']:.2f}]  "
              f"FSDP2 x{args.world} {ranks['median_ms']:6.2f} ms [min {ranks['min_ms']:.2f}]  "
              f"ratio {ranks['median_ms'] / one['median_ms']:.2f}x  goal <= {goal:.1f} ms: "
              f"{'met' if ranks['median_ms'] <= goal else 'NOT met'}  ({one['tensors']} tensors)", flush=True)
        print(f"       training-thread CPU per call: one process {one['cpu_ms_per_rank'][0]:.2f} ms, "
              f"per rank {', '.join(f'{c:.2f}' for c in ranks['cpu_ms_per_rank'])} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
