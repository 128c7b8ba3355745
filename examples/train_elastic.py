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

What it trains like a real job:

* **Data**: a map-style dataset (:class:`SyntheticTokens`, every sample a
  pure function of its index) read through a ``DataLoader`` whose sampler is
  ``sp.ResumableSampler``, wrapped in ``sp.ResumableLoader``. The *global*
  batch is fixed (``--global-batch``, default 8); each data-parallel rank
  takes ``global_batch / dp_world`` samples per step, so a step consumes the
  same number of samples whatever the number of ranks, and the loader's
  global position resumes on any number of ranks with no sample lost or
  repeated within the epoch.
* **Randomness**: residual dropout (``--dropout``, default 0.1) after the
  attention and the MLP of every block, drawn from each rank's torch
  generator, seeded per data-parallel rank (ranks of one tensor-parallel
  group share their stream, so their masks agree).
* **Checkpointed state**: model, optimizer, loader position and
  ``sp.RNGState()`` (every rank's torch/python/numpy generators).

Bit-exact resume: under the same layout, an interrupted and resumed run ends
with the same weights, bit for bit, and the same losses as an uninterrupted
one (``tests/dist/test_elastic.py``). After a relaunch on another number of
ranks the data order continues exactly; the dropout streams of ranks beyond
the old world are derived (``RNGState(on_resize="derive")``), so losses go on
close to, not equal to, an unchanged run.

``--loss-log FILE`` appends one JSON line per step on rank 0 (step, loss
averaged over the global batch, world size, layout, restart attempt), which
``examples/elastic_demo.py`` turns into a table and a plot. ``--samples-log
DIR`` makes the first rank of every data-parallel group append the sample ids
it trained on at each step to ``DIR/rank<r>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import shardpoint as sp
from shardpoint.manager import CheckpointManager, OnDemand, init_distributed
from shardpoint.testing import Block, GPTConfig, build, loss_of

CFG = GPTConfig(vocab=96, dim=64, heads=4, layers=2, seq=16)


class SyntheticTokens(Dataset):
    """``n`` token sequences of length ``seq + 1``; sample ``i`` is a pure function of ``i``.

    Sequences count up with a per-sample stride (mod the vocabulary), so the
    loss visibly falls. Items are ``(i, tokens)``: the id travels with the
    sample so that a run can record what it consumed.
    """

    def __init__(self, n: int, c: GPTConfig = CFG, seed: int = 10_000):
        self.n, self.c, self.seed = n, c, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + int(i))
        start = int(torch.randint(0, self.c.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        return int(i), (start + stride * torch.arange(self.c.seq + 1)) % self.c.vocab


def dp_coords(layout: str, rank: int, world: int) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size of ``layout`` (see ``build``)."""
    if layout == "tp":
        return 0, 1
    if layout == "2d":  # a 2 x (world/2) mesh, ("dp", "tp")
        return rank // (world // 2), 2
    if layout == "single":
        return 0, 1
    return rank, world


def add_dropout(model: torch.nn.Module, p: float) -> None:
    """Residual dropout: after the attention and the MLP of every block (GPT-2 style)."""
    if p <= 0:
        return
    for mod in model.modules():
        if isinstance(mod, Block):  # FSDP2 turns a Block into an FSDPBlock, a subclass
            for sub in (mod.attn, mod.mlp):
                sub.register_forward_hook(lambda m, inp, out: F.dropout(out, p, m.training))


def sync_tp_rng(layout: str) -> None:
    """Ranks of one tensor-parallel group must draw the same dropout masks.

    After a restore on another layout each rank has its own stream; give
    every rank of the group the stream of the group's first rank.
    """
    if layout == "tp" and dist.get_world_size() > 1:
        st = torch.get_rng_state()
        dist.broadcast(st, src=0)
        torch.set_rng_state(st)
    elif layout == "2d":
        world = dist.get_world_size()
        states = [torch.empty_like(torch.get_rng_state()) for _ in range(world)]
        dist.all_gather(states, torch.get_rng_state())
        torch.set_rng_state(states[(dist.get_rank() // (world // 2)) * (world // 2)])


def batches(loader: sp.ResumableLoader):
    """Batches forever, epoch after epoch, from the loader's current position."""
    while True:
        yield from loader


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
    ap.add_argument("--samples-log", default="", help="folder: per-rank JSON lines of consumed sample ids")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="pause per step, to watch a demo")
    ap.add_argument("--samples", type=int, default=256, help="dataset size (samples per epoch)")
    ap.add_argument("--global-batch", type=int, default=8, help="samples per step over all data-parallel ranks")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    # From torchrun's environment, with a store namespace per restart attempt (see its docs).
    init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    dp_rank, dp_world = dp_coords(args.layout, rank, world)
    if args.global_batch % dp_world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {dp_world} data-parallel ranks")

    model, opt = build(args.layout, CFG, seed=0)  # same initial weights everywhere (seeds torch)
    add_dropout(model, args.dropout)
    # Every generator seeded per data-parallel rank, for a fresh start; a resume restores them.
    torch.manual_seed(1_000 + dp_rank)
    random.seed(1_000 + dp_rank)
    np.random.seed(1_000 + dp_rank)

    dataset = SyntheticTokens(args.samples)
    sampler = sp.ResumableSampler(dataset, rank=dp_rank, world_size=dp_world, seed=0)
    # The DataLoader gets its own generator: every iter() of a DataLoader draws a 64-bit base seed
    # (for its workers) from ``generator``, by default the global torch generator. A resumed run
    # starts a fresh iterator mid-epoch, so that draw would shift the global stream against an
    # uninterrupted run. The dataset draws no random numbers in workers, so this seed is not saved.
    loader = sp.ResumableLoader(DataLoader(dataset, batch_size=args.global_batch // dp_world, sampler=sampler,
                                           num_workers=args.workers, generator=torch.Generator().manual_seed(dp_rank)))
    state = {"model": model, "optimizer": opt, "data": loader, "rng": sp.RNGState(),
             "extra": {"step": 0}}
    mgr = CheckpointManager(
        args.root,
        interval=args.interval,
        keep_last=args.keep_last,
        mode=None if args.async_mode == "none" else args.async_mode,
        policies=[OnDemand(signals=[signal.SIGTERM])],  # a preemption notice saves first
        timeout=args.timeout,
    )
    step = mgr.restore(state) or 0
    assert state["extra"]["step"] == step, (state["extra"], step)
    sync_tp_rng(args.layout)
    if rank == 0:
        d = loader.state_dict()
        print(f"[attempt {attempt}] world {world} layout {args.layout}: "
              f"{'resumed after step ' + str(step) if step else 'starting fresh'} "
              f"(data epoch {d['epoch']} position {d['position']})", flush=True)
    if args.loss_log and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
    log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None  # noqa: SIM115 - open for the whole run
    samples_log = None
    if args.samples_log and rank == min(r for r in range(world) if dp_coords(args.layout, r, world)[0] == dp_rank):
        os.makedirs(args.samples_log, exist_ok=True)
        samples_log = open(os.path.join(args.samples_log, f"rank{rank}.jsonl"), "a")  # noqa: SIM115
    model.train()
    it = batches(loader)  # iterates from the restored position on first use
    while step < args.steps:
        step += 1
        epoch = loader.epoch
        ids, seq = next(it)
        loss = loss_of(model, seq[:, :-1], seq[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone() / world  # the loss of the global batch, for the log
        dist.all_reduce(mean)
        state["extra"] = {"step": step}
        if samples_log is not None:
            samples_log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids.tolist(), "rank": rank,
                                          "dp_rank": dp_rank, "world": world, "layout": args.layout,
                                          "attempt": attempt, "run": run_id}) + "\n")
            samples_log.flush()
        if log is not None:
            log.write(json.dumps({"step": step, "loss": float(mean), "world": world, "layout": args.layout,
                                  "attempt": attempt, "run": run_id, "time": time.time()}) + "\n")
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
