"""Lose a host, resume from peers' memory: peer-memory checkpoints under torchrun's elastic restarts.

Four ranks play two hosts (``h0``: ranks 0-1, ``h1``: ranks 2-3), each with
its own memory folder. Every step is checkpointed into host memory and
replicated to the other host; every 5th step also goes to disk. On the first
attempt, after step 13, the ranks of ``h1`` delete h1's memory folder and
SIGKILL themselves: the host is gone. torchrun restarts the group, and the
restore resumes from step 13 (the last memory step, not the stored step 10),
printing which host served each rank's bytes and the restore's slowest
phases (``RestoreReport.seconds``). Then the same run continues
on 2 ranks (one host), resharding from memory again.

Run::

    python examples/peer_memory_demo.py --out demo_out/peer

(the script starts torchrun itself; ``--worker`` is the per-rank entry point).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PER_HOST = 2


def worker(out: str, steps: int, kill_at: int) -> None:
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.manager import CheckpointManager, init_distributed
    from shardpoint.testing import GPTConfig, build, train_step

    rank = int(os.environ["RANK"])
    host = f"h{rank // PER_HOST}"
    os.environ["SHARDPOINT_HOST"] = host
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_distributed("gloo")
    cfg = GPTConfig(vocab=96, dim=64, heads=4, layers=2, seq=16)
    model, opt = build("fsdp2", cfg, seed=0)
    state = {"model": model, "optimizer": opt}
    mem = sp.PeerMemory(dir=os.path.join(out, "mem", host), replicas=1, interval=1)
    mgr = CheckpointManager(os.path.join(out, "run"), interval=5, memory=mem, mode=None, timeout=120)
    t0 = time.monotonic()
    start = mgr.restore(state) or 0
    rep = mgr.last_restore
    if rep is not None:
        print(f"[attempt {attempt}] rank {rank} ({host}, world {dist.get_world_size()}): resumed at step {start} "
              f"from {rep.source} in {time.monotonic() - t0:.2f}s; bytes by host: {dict(rep.bytes_from)}", flush=True)
        slow = sorted(((v, k) for k, v in rep.seconds.items() if not k.endswith("total") and k != "load"), reverse=True)[:3]
        print(f"[attempt {attempt}] rank {rank}: slowest restore phases: "
              + ", ".join(f"{k} {v:.3f}s" for v, k in slow), flush=True)
    for step in range(start + 1, steps + 1):
        train_step(model, opt, step, cfg)
        mgr.maybe_save(step, state)
        if attempt == 0 and step == kill_at and host == "h1":
            mem.wait()
            if rank % PER_HOST == 0:
                shutil.rmtree(mem.dir, ignore_errors=True)
            print(f"rank {rank}: host {host} lost after step {step} (memory folder deleted, SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    dist.destroy_process_group()


def torchrun(nproc: int, out: str, steps: int, kill_at: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--max-restarts=1", os.path.abspath(__file__), "--worker", "--out", out,
           "--steps", str(steps), "--kill-at", str(kill_at)]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="demo_out/peer")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill-at", type=int, default=13)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.out, a.steps, a.kill_at)
        return
    shutil.rmtree(a.out, ignore_errors=True)
    torchrun(4, a.out, a.steps, a.kill_at)      # h1 lost after step 13; torchrun restarts; resume at 13
    torchrun(2, a.out, a.steps + 4, a.kill_at)  # carry on with one host: resharded from h0's memory


if __name__ == "__main__":
    main()
