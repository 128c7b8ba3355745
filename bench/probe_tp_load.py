"""Probe: where a cold FSDP2 4 -> TP 2 resharding load spends its time (shardpoint only).

Not a peer comparison (bench_load.py is): it saves the bench_load state
(TinyGPT dim 768, 5 layers, AdamW after two steps) from 4 FSDP2 ranks, then
loads it 6 times into TP on 2 ranks with ``share_reads=False``, dropping the
page cache before each load (root only), and prints each rank's wall time
and phase timings (``read`` and ``verify`` sum over reader threads).

    python bench/probe_tp_load.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

CFG = dict(vocab=2048, dim=768, heads=12, layers=5, seq=16)


def save_job(rank: int, world: int, root: str) -> None:
    import shardpoint as sp
    from shardpoint.testing import GPTConfig, batch, build, loss_of

    c = GPTConfig(**CFG)
    model, opt = build("fsdp2", c, seed=0)
    for i in range(2):
        x, y = batch(i, c, 4)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sp.save(root, {"model": model, "optimizer": opt})


def load_job(rank: int, world: int, root: str) -> list:
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build

    model, opt = build("tp", GPTConfig(**CFG), seed=1)
    out = []
    for _ in range(6):
        if rank == 0:
            C.drop_caches()
        dist.barrier()
        rep = sp.LoadResult()
        t = time.perf_counter()
        sp.load(root, {"model": model, "optimizer": opt}, report=rep, share_reads=False)
        out.append((round(time.perf_counter() - t, 3), {k: round(v, 3) for k, v in rep.timings.items()}))
    return out


def main() -> int:
    C.setup_env()
    from shardpoint.testing import launch

    root = os.path.join(tempfile.mkdtemp(prefix="sp-probe-"), "ck")
    launch(4, "probe_tp_load:save_job", {"root": root})
    for rank, runs in enumerate(launch(2, "probe_tp_load:load_job", {"root": root})):
        print(f"rank {rank}: wall s {[w for w, _ in runs]}")
        print(f"  last phases {runs[-1][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
