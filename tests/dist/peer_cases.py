"""Rank functions for peer-memory checkpoints on gloo: 2 ranks per simulated host (see test_peer.py)."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.manager import CheckpointManager
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=96, dim=32, heads=4, layers=2, seq=16)
PER_HOST = 2


def _host(rank: int) -> str:
    return f"h{rank // PER_HOST}"


def _memory(root: str, rank: int, replicas: int = 1, budget: int = 256 << 20) -> sp.PeerMemory:
    os.environ["SHARDPOINT_HOST"] = _host(rank)
    return sp.PeerMemory(dir=os.path.join(root, "mem", _host(rank)), replicas=replicas, interval=1, budget_bytes=budget)


def _diff(ref: dict, got: dict) -> list[str]:
    return [k for k in ref if not torch.equal(ref[k], got[k])]


def _restore(root: str, rank: int, layout: str = "fsdp2", seed: int = 7) -> tuple[dict, dict]:
    model, opt = build(layout, CFG, seed=seed)
    mgr = CheckpointManager(os.path.join(root, "run"), interval=5, memory=_memory(root, rank), mode=None, timeout=120)
    step = mgr.restore({"model": model, "optimizer": opt})
    rep = mgr.last_restore
    out = {
        "step": step,
        "source": None if rep is None else rep.source,
        "rank_source": None if rep is None else rep.rank_source,
        "bytes_from": {} if rep is None else dict(rep.bytes_from),
        "storage_read": mgr.storage.stats.bytes_read,
        "attempts": None if rep is None or rep.source == "storage" else rep.attempts,
    }
    mgr.close()
    folder = mgr.memory.dir
    out["memory_folders"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return out, full_state(model, opt)


def train_job(rank: int, world: int, root: str, steps: int = 12, kill_at: int | None = None, kill_round: int = 0,
              budget: int = 256 << 20) -> dict:
    """FSDP2 for ``steps`` steps with a memory checkpoint every step and a stored one every 5; no final save.

    With ``kill_at``, host h1's ranks are SIGKILLed in round ``kill_round`` of that step's replication
    (a small ``budget`` makes several rounds)."""
    model, opt = build("fsdp2", CFG, seed=0)
    mem = _memory(root, rank, budget=budget)
    mgr = CheckpointManager(os.path.join(root, "run"), interval=5, memory=mem, mode=None, timeout=60)
    refs = {}
    for step in range(1, steps + 1):
        train_step(model, opt, step, CFG)
        refs[step] = full_state(model, opt)
        if rank == 0 and (step >= steps - 2 or step == 10):
            keep = {s: refs[s] for s in refs if s >= steps - 2 or s == 10}
            torch.save(keep, os.path.join(root, "refs.pt"))
        if kill_at == step and _host(rank) == "h1":
            mem.kill_during_replication = kill_round  # this host dies while sending its copies
        mgr.maybe_save(step, {"model": model, "optimizer": opt})
    mgr.close()
    return {"memory_steps": mem.steps(), "stored": mgr.steps()}


def lose(root: str, *what: str) -> None:
    for w in what:
        if w == "root-away":
            os.rename(os.path.join(root, "run"), os.path.join(root, "run.away"))
        elif w == "root-back":
            os.rename(os.path.join(root, "run.away"), os.path.join(root, "run"))
        else:
            shutil.rmtree(os.path.join(root, "mem", w), ignore_errors=True)


def restore_job(rank: int, world: int, root: str, scenarios: list) -> dict:
    """Each scenario: (files to lose before it, layout, expected step). Rank 0 changes the files between barriers."""
    refs = torch.load(os.path.join(root, "refs.pt"))
    out = []
    for losses, layout, corrupt in scenarios:
        bad = None
        if rank == 0:
            lose(root, *losses)
            if corrupt:
                from shardpoint.testing import flip_byte

                folder = os.path.join(root, "mem", corrupt)
                steps = sorted(n for n in os.listdir(folder) if n.startswith("step_"))
                man = sp.read_manifest(os.path.join(folder, steps[-1]))
                own = man.ranks[PER_HOST * int(corrupt[1:])].data  # the host's own first rank's data file
                flip_byte(os.path.join(folder, steps[-1], own), 64)
                bad = next(c.nbytes for t in man.tensors.values() for c in t.chunks
                           if c.file == own and c.offset <= 64 < c.offset + c.nbytes)
        dist.barrier()
        res, got = _restore(root, rank, layout)
        res["corrupt_chunk_bytes"] = bad
        res["diff"] = _diff(refs[res["step"]], got) if res["step"] in refs else ["<no reference>"]
        out.append(res)
        dist.barrier()
    return out
