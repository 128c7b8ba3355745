"""Probe: the async save's blocking work (``save_steps.prepare_save``) per rank, uncontended.

Not a peer comparison: it explains bench_async's stall. Four FSDP2 ranks
(TinyGPT dim 768, 3 layers, AdamW after two steps, as in bench_async) take
turns, so only one rank works at a time, and each times 20 calls of
``prepare_save`` with an AsyncSaver-style cache (the second and later calls reuse
the previous parts). Prints the median per rank in ms.

    python bench/probe_prepare.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def job(rank: int, world: int) -> float:
    import torch.distributed as dist

    from shardpoint.save_steps import SaveCache, SaveResult, prepare_save
    from shardpoint.dist import Comm
    from shardpoint.monitor import Recorder
    from shardpoint.testing import GPTConfig, batch, build, loss_of

    c = GPTConfig(vocab=2048, dim=768, heads=12, layers=3, seq=64)
    model, opt = build("fsdp2", c, seed=0, lr=1e-4)
    for i in range(2):
        x, y = batch(i, c, 4)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    comm, cache, out = Comm.resolve(None), SaveCache(), 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                prepare_save({"model": model, "optimizer": opt}, comm, False, "x", SaveResult("x", "y", recorder=Recorder("save", "x", rank)), (), cache)
                ts.append(time.perf_counter() - t)
            out = sorted(ts)[len(ts) // 2]
    dist.barrier()
    return out


def main() -> int:
    C.setup_env()
    from shardpoint.testing import launch

    res = launch(4, "probe_prepare:job", {})
    print("median prepare_save per rank, ms:", [round(t * 1e3, 2) for t in res])
    return 0


if __name__ == "__main__":
    sys.exit(main())
