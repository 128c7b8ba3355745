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

With ``--s3`` the step is also saved to S3 on loopback (a moto server in
its own process, objects in memory) and recovered from there. Each
recovery is repeated ``--repeat`` times, interleaved, into a freshly built
model and optimizer; the median of the slowest rank is reported, with the
peer restore's phases (see ``RestoreReport.seconds``).

Usage::

    python bench/bench_peer.py --size 100mb --overhead-steps 20
    python bench/bench_peer.py --size 1.5gb --s3 --repeat 3 --json peer.json
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PER_HOST = 2
TINY = dict(vocab=96, dim=32, heads=4, layers=2, seq=16)


def _restore(kind: str, rank: int, root: str, mem_dir: str, cfg: dict, ref: dict, s3: dict | None) -> dict:
    """One recovery into a freshly built model and optimizer: time, source, bit-exactness, bytes read."""
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, build

    c = GPTConfig(**cfg)
    m2, o2 = build("fsdp2", c, seed=1)
    dropped = C.drop_caches() if (kind == "disk" and rank == 0) else None
    dist.barrier()
    where, opts = (s3["url"], s3["options"]) if kind == "s3" else (root, None)
    m = sp.CheckpointManager(where, interval=1, timeout=600, storage_options=opts,
                             memory=sp.PeerMemory(dir=mem_dir, replicas=1) if kind == "memory" else None)
    t0 = time.monotonic()
    step = m.restore({"model": m2, "optimizer": o2})
    dist.barrier()
    out = {"s": time.monotonic() - t0, "source": m.last_restore.source, "step": step,
           "diff": C.diff_hashes(ref, C.local_hashes(m2, o2)), "storage_read": m.storage.stats.bytes_read,
           "phases": dict(m.last_restore.seconds) if kind == "memory" else {},
           "bytes_from": dict(m.last_restore.bytes_from)}
    if dropped is not None:
        out["cache_dropped"] = dropped
    m.close()
    return out


def job(rank: int, world: int, root: str, mem_root: str, cfg: dict, repeat: int = 1, s3: dict | None = None) -> dict:
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
    state_bytes = C.local_state_bytes(model, opt)
    mem = sp.PeerMemory(dir=mem_dir, replicas=1, interval=1)
    mgr = sp.CheckpointManager(root, interval=1, memory=mem, mode=None, timeout=600)
    peak = C.PeakRss()
    rss0 = peak.rss()
    t0 = time.monotonic()
    mgr.maybe_save(1, {"model": model, "optimizer": opt})
    mgr.wait()
    save_s = time.monotonic() - t0
    rss_growth = peak.peak() - rss0 if peak.available else None
    mgr.close()
    if s3 is not None:  # the same step on S3 (moto on loopback), for the third anchor
        ms3 = sp.CheckpointManager(s3["url"], interval=1, mode=None, timeout=600, storage_options=s3["options"])
        ms3.maybe_save(1, {"model": model, "optimizer": opt})
        ms3.close()
    used = C.dir_bytes(mem_dir)
    budget = mem.budget_bytes
    del model, opt, mgr, mem  # the recoveries run in fresh state, as in a restarted job
    gc.collect()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(mem_root, "h1"))
    dist.barrier()
    out = {"save_s": save_s, "memory_bytes_host": used, "budget_bytes": budget, "state_bytes_rank": state_bytes,
           "save_rss_growth": rss_growth, "runs": []}
    kinds = ("memory", "disk") + (("s3",) if s3 is not None else ())
    for _ in range(repeat):  # interleaved, so that load from other work on the machine hits each alike
        out["runs"].append({k: _restore(k, rank, root, mem_dir, cfg, ref, s3) for k in kinds})
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
        mgr = sp.CheckpointManager(os.path.join(root, system), interval=None, memory=mem, mode=None) if system == "peer" else None
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
    ap.add_argument("--repeat", type=int, default=3, help="recoveries of each kind (the median is reported)")
    ap.add_argument("--s3", action="store_true", help="also recover from S3 on loopback (a moto server)")
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

    s3, moto = None, None
    if a.s3:
        import boto3
        from bench_s3 import start_moto

        moto, endpoint = start_moto()
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="bench-peer")
        s3 = {"url": "s3://bench-peer/run", "options": {"endpoint_url": endpoint, "access_key_id": "testing",
                                                         "secret_access_key": "testing", "region": "us-east-1"}}
    try:
        with tempfile.TemporaryDirectory() as disk, tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
            res = launch(4, "bench_peer:job", {"root": os.path.join(disk, "run"), "mem_root": shm, "cfg": cfg,
                                               "repeat": a.repeat, "s3": s3}, timeout=3600)
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
    kinds = list(res[0]["runs"][0])
    # Per run, the slowest rank; over the runs, the median.
    walls = {k: [max(r["runs"][i][k]["s"] for r in res) for i in range(a.repeat)] for k in kinds}
    med = {k: statistics.median(v) for k, v in walls.items()}
    names = sorted({p for r in res for run in r["runs"] for p in run["memory"]["phases"]})
    phases = {p: statistics.median(max(r["runs"][i]["memory"]["phases"].get(p, 0.0) for r in res) for i in range(a.repeat))
              for p in names}
    report = {
        "size": a.size, "ranks": res, "repeat": a.repeat, "walls": walls,
        "recovery_memory_s": med["memory"], "recovery_cold_disk_s": med["disk"], "recovery_s3_s": med.get("s3"),
        "ratio_memory_over_disk": med["memory"] / med["disk"],
        "memory_phases_s": phases,
        "bit_exact": all(not run[k]["diff"] for r in res for run in r["runs"] for k in kinds),
        "memory_storage_bytes_read": sum(run["memory"]["storage_read"] for r in res for run in r["runs"]),
        "memory_bytes_per_host": max(r["memory_bytes_host"] for r in res),
        "state_bytes": sum(r["state_bytes_rank"] for r in res),
        "budget_bytes": res[0]["budget_bytes"],
        "save_rss_growth_max": max((r["save_rss_growth"] or 0) for r in res),
        "cache_dropped": all(run["disk"].get("cache_dropped") for run in res[0]["runs"]),
        "overhead_every_step": overhead,
        "commit": C.git_rev(),
    }
    s3txt = f", S3 on loopback {med['s3']:.2f}s" if "s3" in med else ""
    print(f"recovery after losing h1 ({a.size}, median of {a.repeat}): peers' memory {med['memory']:.2f}s, cold disk "
          f"{med['disk']:.2f}s{s3txt} (memory / disk {report['ratio_memory_over_disk']:.2f}; page cache dropped: "
          f"{report['cache_dropped']}); runs: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in walls.items()))
    print("peer restore phases (slowest rank, median): " + ", ".join(f"{p} {v:.3f}s" for p, v in phases.items()))
    print(f"bit-exact: {report['bit_exact']}; stored bytes read by the memory restores: {report['memory_storage_bytes_read']}; "
          f"memory per host {report['memory_bytes_per_host'] / 1e6:.1f} MB for {report['state_bytes'] / 1e6:.1f} MB of state; "
          f"save's peak RSS growth per rank {report['save_rss_growth_max'] / 1e6:.1f} MB "
          f"(replication budget {report['budget_bytes'] / 2**20:.0f} MiB per rank)")
    if a.json:
        C.write_json(a.json, report)


if __name__ == "__main__":
    main()
