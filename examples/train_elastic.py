"""Fault-tolerant training of a small GPT under torchrun, resumed by CheckpointManager.

torchrun's elastic agent is the restart engine: when a rank dies, it stops
the group and starts it again (up to ``--max-restarts``), and this script
resumes from the newest complete checkpoint. A relaunch with another
``--nproc_per_node`` and ``--layout`` resumes too: ``restore`` reshards.

Run it (CPU, gloo)::

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 \\
        examples/train_elastic.py --root ckpt/elastic --steps 40 --layout fsdp2

    # kill rank 2 after step 13 on the first attempt; torchrun restarts the group
    KILL_AT_STEP=13 KILL_RANK=2 torchrun --standalone --nproc_per_node=4 --max-restarts=3 \\
        examples/train_elastic.py --root ckpt/elastic --steps 40

    # carry on with 2 ranks under tensor parallelism
    torchrun --standalone --nproc_per_node=2 examples/train_elastic.py \\
        --root ckpt/elastic --steps 60 --layout tp

Bit-exact resume: every batch is a pure function of the step
(:func:`batch`), so the data position is the step itself,
and the model has no dropout, so no RNG stream needs restoring. Under the
same layout, an interrupted and resumed run ends with the same weights, bit
for bit, as an uninterrupted one (``tests/dist/test_elastic.py``). A model
with dropout would also save ``torch.get_rng_state()`` per rank.

``--loss-log FILE`` appends one JSON line per step on rank 0 (step, loss,
world size, layout, restart attempt), which ``examples/elastic_demo.py``
turns into a table and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from shardpoint.manager import CheckpointManager, OnDemand, init_distributed
from shardpoint.testing import GPTConfig, build, loss_of

CFG = GPTConfig(vocab=96, dim=64, heads=4, layers=2, seq=16)
BATCH = 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a pure function of the step, identical on every rank.

    Sequences count up with a per-sequence stride (mod the vocabulary), so the
    loss visibly falls. Because the batch depends on the step only, the data
    position to resume from is the step itself.
    """
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, CFG.vocab, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(CFG.seq + 1)) % CFG.vocab
    return seq[:, :-1], seq[:, 1:]


def train_step(model, opt, step: int) -> float:
    x, y = batch(step)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="run folder or URL for the checkpoints")
    ap.add_argument("--steps", type=int, default=40, help="train until this many steps are done")
    ap.add_argument("--layout", default="fsdp2", choices=["fsdp2", "tp", "ddp", "hsdp", "2d", "single"])
    ap.add_argument("--interval", type=int, default=5, help="save every N steps")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--async-mode", default="lazy", choices=["eager", "lazy", "none"])
    ap.add_argument("--timeout", type=float, default=300.0, help="hang timeout of checkpoint phases (s)")
    ap.add_argument("--loss-log", default="", help="append per-step JSON lines here (rank 0)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="pause per step, to watch a demo")
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    # From torchrun's environment, with a store namespace per restart attempt (see its docs).
    init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))

    model, opt = build(args.layout, CFG, seed=0)
    # "extra" carries the data position; here it equals the step, and is checked on resume.
    state = {"model": model, "optimizer": opt, "extra": {"step": 0, "samples": 0}}
    mgr = CheckpointManager(
        args.root,
        interval=args.interval,
        keep_last=args.keep_last,
        async_mode=None if args.async_mode == "none" else args.async_mode,
        policies=[OnDemand(signals=[signal.SIGTERM])],  # a preemption notice saves first
        timeout=args.timeout,
    )
    step = mgr.restore(state) or 0
    assert state["extra"]["step"] == step, (state["extra"], step)
    if rank == 0:
        print(f"[attempt {attempt}] world {world} layout {args.layout}: "
              f"{'resumed after step ' + str(step) if step else 'starting fresh'}", flush=True)
    log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None
    while step < args.steps:
        step += 1
        loss = train_step(model, opt, step)
        state["extra"] = {"step": step, "samples": step * BATCH}
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss, "world": world, "layout": args.layout,
                                  "attempt": attempt, "time": time.time()}) + "\n")
            log.flush()
        mgr.maybe_save(step, state)
        if attempt == 0 and step == kill_at and rank == kill_rank:
            print(f"[attempt {attempt}] rank {rank}: killed by SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if mgr.stop_requested:
            if rank == 0:
                print(f"stopping after step {step} on request", flush=True)
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if step == args.steps:
        mgr.save(step, state)  # the final state is always on storage
    mgr.close()
    if rank == 0:
        print(f"[attempt {attempt}] done at step {step}; checkpoints {mgr.steps()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
