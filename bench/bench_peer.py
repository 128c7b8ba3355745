"""Recovery after losing one host: peers' memory against a cold load from local disk.

Four gloo ranks play two hosts of two ranks (FSDP2 TinyGPT + AdamW). One
step is checkpointed to peer memory (``sp.PeerMemory``, ``replicas=1``) and to
a local-disk run root. Then host ``h1``'s memory folder is deleted and every
rank restores, once from the surviving memory (own host, and peers' copies
served over the process group), once from the disk with the page cache
dropped (when allowed: root). Both restores are checked bit-exact. It prints
the two recovery times and their ratio (goal: memory <= 1/5 of cold disk),
and the memory the memory checkpoints take against their budget.

With ``--overhead-steps N`` it also times the training loop (4 ranks, N
steps) with no checkpoint, with a peer-memory checkpoint every step and with
DCP's ``async_save`` every step, and prints each one's step-time overhead
(goal: peer memory at most 5%).

Usage::

    python bench/bench_peer.py --size 100mb --overhead-steps 20
    python bench/bench_peer.py --size 1.5gb --json peer.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PER_HOST = 2
TINY = dict(vocab=96, dim=32, heads=4, layers=2, seq=16)


def job(rank: int, world: int, root: str, mem_root: str, cfg: dict) -> dict:
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build, train_step

    c = GPTConfig(**cfg)
    host = f"h{rank // PER_HOST}"
    os.environ["SHARDPOINT_HOST"] = host
    mem_dir = os.path.join(mem_root, host)
    model, opt = build("fsdp2", c, seed=0)
    train_step(model, opt, 1, c)
    ref = C.local_hashes(model, opt)
    mem = sp.PeerMemory(dir=mem_dir, replicas=1, interval=1)
    mgr = sp.CheckpointManager(root, interval=1, memory=mem, async_mode=None, timeout=600)
    t0 = time.monotonic()
    mgr.maybe_save(1, {"model": model, "optimizer": opt})
    mgr.wait()
    save_s = time.monotonic() - t0
    mgr.close()
    used = C.dir_bytes(mem_dir)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(mem_root, "h1"))
    dist.barrier()
    out = {"save_s": save_s, "memory_bytes_host": used, "budget_bytes": mem.budget_bytes}
    for kind in ("memory", "disk"):
        m2, o2 = build("fsdp2", c, seed=1)
        dropped = C.drop_caches() if (kind == "disk" and rank == 0) else None
        dist.barrier()
        m = sp.CheckpointManager(root, interval=1, timeout=600,
                                 memory=sp.PeerMemory(dir=mem_dir, replicas=1) if kind == "memory" else None)
        t0 = time.monotonic()
        step = m.restore({"model": m2, "optimizer": o2})
        dist.barrier()
        out[f"{kind}_s"] = time.monotonic() - t0
        out[f"{kind}_source"] = m.last_restore.source
        out[f"{kind}_step"] = step
        out[f"{kind}_diff"] = C.diff_hashes(ref, C.local_hashes(m2, o2))
        out[f"{kind}_storage_read"] = m.storage.stats.bytes_read
        if dropped is not None:
            out["cache_dropped"] = dropped
        m.close()
    return out


def overhead_job(rank: int, world: int, root: str, mem_root: str, cfg: dict, steps: int) -> dict:
    """Loop time per step: no checkpoints, a peer-memory checkpoint every step, DCP async_save every step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build, train_step

    c = GPTConfig(**cfg)
    os.environ["SHARDPOINT_HOST"] = f"h{rank // PER_HOST}"
    model, opt = build("fsdp2", c, seed=0)
    train_step(model, opt, 0, c)
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives must not share the training group
    out = {}
    for system in ("none", "peer", "dcp", "none2"):
        mem = sp.PeerMemory(dir=os.path.join(mem_root, system, os.environ["SHARDPOINT_HOST"]), replicas=1, interval=1)
        mgr = sp.CheckpointManager(os.path.join(root, system), interval=None, memory=mem, async_mode=None) if system == "peer" else None
        fut = None
        if mgr is not None:
            mgr.maybe_save(0, {"model": model, "optimizer": opt})  # warm-up: groups, staging, plans
            mgr.wait()
        dist.barrier()
        t0 = time.monotonic()
        for step in range(1, steps + 1):
            train_step(model, opt, step, c)
            if system == "peer":
                mgr.maybe_save(step, {"model": model, "optimizer": opt})
            elif system == "dcp":
                if fut is not None:
                    fut.result()
                fut = dcp.async_save(C.dcp_state(model, opt), checkpoint_id=os.path.join(root, "dcp", str(step)),
                                       process_group=dcp_pg)
        if fut is not None:
            fut.result()
        if mgr is not None:
            mgr.close()
        dist.barrier()
        out[system] = (time.monotonic() - t0) / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100mb", choices=sorted(C.SIZES) + ["tiny"], help="tiny: a smoke run")
    ap.add_argument("--json", default="")
    ap.add_argument("--overhead-steps", type=int, default=0, help="also time the loop with a checkpoint every step")
    a = ap.parse_args()
    C.setup_env()
    from shardpoint.testing import launch

    cfg = TINY if a.size == "tiny" else C.size_cfg(a.size)
    overhead = None
    if a.overhead_steps:
        with tempfile.TemporaryDirectory() as disk, tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
            res = launch(4, "bench_peer:overhead_job", {"root": disk, "mem_root": shm, "cfg": cfg, "steps": a.overhead_steps}, timeout=3600)
        base = max(min(r["none"], r["none2"]) for r in res)
        overhead = {k: max(r[k] for r in res) / base - 1 for k in ("peer", "dcp")}
        print(f"step-time overhead of a checkpoint every step ({a.size}, {a.overhead_steps} steps): peer memory "
              f"{overhead['peer']:+.1%}, DCP async_save {overhead['dcp']:+.1%} (baseline {base * 1e3:.1f} ms/step)")

    with tempfile.TemporaryDirectory() as disk, tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        res = launch(4, "bench_peer:job", {"root": os.path.join(disk, "run"), "mem_root": shm, "cfg": cfg}, timeout=1800)
    worst = {k: max(r[k] for r in res) for k in ("memory_s", "disk_s", "save_s")}
    report = {
        "size": a.size, "ranks": res,
        "recovery_memory_s": worst["memory_s"], "recovery_cold_disk_s": worst["disk_s"],
        "ratio_memory_over_disk": worst["memory_s"] / worst["disk_s"],
        "bit_exact": all(not r["memory_diff"] and not r["disk_diff"] for r in res),
        "memory_storage_bytes_read": sum(r["memory_storage_read"] for r in res),
        "memory_bytes_per_host": max(r["memory_bytes_host"] for r in res),
        "cache_dropped": res[0].get("cache_dropped"),
        "overhead_every_step": overhead,
        "commit": C.git_rev(),
    }
    print(f"recovery after losing h1 ({a.size}): peers' memory {worst['memory_s']:.2f}s, cold disk "
          f"{worst['disk_s']:.2f}s (ratio {report['ratio_memory_over_disk']:.2f}; page cache dropped: "
          f"{report['cache_dropped']}); bit-exact: {report['bit_exact']}; stored bytes read by the memory restore: "
          f"{report['memory_storage_bytes_read']}; memory per host {report['memory_bytes_per_host'] / 1e6:.1f} MB")
    if a.json:
        C.write_json(a.json, report)


if __name__ == "__main__":
    main()
