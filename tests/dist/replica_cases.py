"""Rank functions for the replica check and replication declared per tensor (run by shardpoint.testing.launch).

All cases run in one process group: per-rank plain tensors are refused,
DDP replicas pass, groups declared by pattern keep each group's values, and
a wrong declaration is refused with the checkpoint at the path left intact.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import shardpoint as sp


class Moe(nn.Module):
    """A dense layer shared by every rank and a per-rank list of local experts."""

    def __init__(self, local: int = 2, dim: int = 6):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(local))
        self.register_buffer("bias", torch.zeros(local))


def _seeded(seed: int, local: int = 2) -> Moe:
    torch.manual_seed(seed)
    return Moe(local)


def _error(fn) -> list:
    try:
        fn()
    except sp.CheckpointError as e:
        return [type(e).__name__, str(e), getattr(e, "tensor", ""), getattr(e, "groups", [])]
    return []


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _step(model: nn.Module, opt, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(4, 6)
    y = model.dense(x)
    for e in model.experts:
        y = y + e(x)
    y.square().sum().backward()
    opt.step()
    opt.zero_grad()


def per_rank_job(rank: int, world: int, root: str) -> dict:
    """P1 and P1c: per-rank plain tensors are refused (the path keeps its checkpoint); DDP replicas pass."""
    out: dict = {}
    path = os.path.join(root, "p1")
    good = _seeded(0)
    sp.save(path, {"model": good})
    bad = _seeded(0)
    with torch.no_grad():
        bad.experts[0].weight.add_(rank)  # differs on every rank but rank 0
    out["p1"] = _error(lambda: sp.save(path, {"model": bad}))
    out["p1_async"] = _error(lambda: sp.async_save(path, {"model": bad}).wait())
    back = _seeded(5)
    sp.load(path, {"model": back})
    out["p1_kept"] = _same(good.state_dict(), back.state_dict())
    # A per-rank buffer that differs by one element only is caught as well.
    buf = _seeded(0)
    buf.bias[1] = float(rank == world - 1)
    out["p1_buffer"] = _error(lambda: sp.save(os.path.join(root, "p1b"), {"model": buf}))
    # P1c: real DDP replicas.
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Moe())
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    _step(ddp.module, opt, 1)
    sp.save(os.path.join(root, "ddp"), {"model": ddp, "optimizer": opt})
    fresh = nn.parallel.DistributedDataParallel(_seeded(9))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    sp.load(os.path.join(root, "ddp"), {"model": fresh, "optimizer": opt2})
    out["ddp_model"] = _same(ddp.module.state_dict(), fresh.module.state_dict())
    out["ddp_opt"] = [
        n for p, q in zip(ddp.parameters(), fresh.parameters()) for n in ("exp_avg", "exp_avg_sq", "step")
        if not torch.equal(opt.state[p][n], opt2.state[q][n])
    ]
    return out


def groups_job(rank: int, world: int, root: str) -> dict:
    """P2 and P2w on 4 ranks: experts replicated within {0,1} and {2,3}, the dense part everywhere."""
    group = [0, 1] if rank < 2 else [2, 3]
    out: dict = {}
    model = _seeded(0)
    torch.manual_seed(100 + group[0])  # each group's experts differ from the other's
    with torch.no_grad():
        for e in model.experts:
            e.weight.normal_()
        model.bias.fill_(float(group[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 1 + group[0])
    with torch.no_grad():  # the dense part is the same everywhere, as a data-parallel all-reduce would make it
        for p in model.dense.parameters():
            dist.broadcast(p, 0)
    for p in model.dense.parameters():
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            dist.broadcast(st[k], 0)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    path = os.path.join(root, "groups")
    decl = {"model.experts.*": group, "model.bias": group, "*": None}
    sp.save(path, {"model": model, "optimizer": opt}, replicated_over=decl)
    names = sorted(sp.read_manifest(path, chunks=False).tensors)
    out["names"] = names
    fresh = _seeded(7)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    _step(fresh, opt2, 50)
    sp.load(path, {"model": fresh, "optimizer": opt2}, replicated_over=decl)  # the same declaration, optional here
    out["p2_model"] = _same(ref, fresh.state_dict())
    out["p2_opt"] = [
        f"{i}.{k}" for i, p in enumerate(fresh.parameters()) for k, v in opt2.state[p].items() if not torch.equal(ref_opt[(i, k)], v)
    ]
    # The list-of-pairs form, with the dense part left to the default.
    sp.save(os.path.join(root, "pairs"), {"model": model}, replicated_over=[("model.experts.*", group), ("model.bias", group)])
    again = _seeded(8)
    sp.load(os.path.join(root, "pairs"), {"model": again})
    out["pairs"] = _same(ref, again.state_dict())
    # The asynchronous saver runs the same check and stores the same per-group copies, twice in a row.
    for _ in range(2):
        sp.async_save(os.path.join(root, "async"), {"model": model}, replicated_over=decl).wait()
    again = _seeded(9)
    sp.load(os.path.join(root, "async"), {"model": again})
    out["async"] = _same(ref, again.state_dict())
    # P2w: every rank declared a replica of every other while the groups differ.
    out["p2w"] = _error(lambda: sp.save(path, {"model": model}, replicated_over=[0, 1, 2, 3]))
    out["p2w_pattern"] = _error(lambda: sp.save(path, {"model": model}, replicated_over={"model.experts.*": [0, 1, 2, 3]}))
    kept = _seeded(3)
    sp.load(path, {"model": kept}, strict=False)
    out["p2w_kept"] = _same(ref, kept.state_dict())
    return out


def _failure(fn) -> list:
    """``[class name, message, tensor, groups, where]``: where the error surfaced (``call`` or ``wait``)."""
    try:
        h = fn()
    except sp.CheckpointError as e:
        return [type(e).__name__, str(e), getattr(e, "tensor", ""), getattr(e, "groups", []), "call"]
    if h is not None:
        try:
            h.wait()
        except sp.CheckpointError as e:
            return [type(e).__name__, str(e), getattr(e, "tensor", ""), getattr(e, "groups", []), "wait"]
    return []


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _counted(out: dict, key: str, fn) -> None:
    """Run ``fn``, counting the gathers of int64 tables (the replica check's before the write) it makes."""
    from shardpoint.dist import Comm

    real, calls = Comm.all_gather_rows, []

    def counting(self, rows):
        calls.append(tuple(rows.shape))
        return real(self, rows)

    Comm.all_gather_rows = counting
    try:
        fn()
    finally:
        Comm.all_gather_rows = real
    out[key] = len(calls)


def commit_job(rank: int, world: int, root: str) -> dict:
    """Without declared groups the copies are compared at the commit: no gather before the write, the same error everywhere."""
    out: dict = {}
    path = os.path.join(root, "folded")
    good = _seeded(0)
    _counted(out, "gathers_plain", lambda: sp.save(path, {"model": good}))
    _counted(out, "gathers_declared", lambda: sp.save(os.path.join(root, "declared"), {"model": good}, replicated_over=list(range(world))))
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        manifest = f.read()
    files = _files(path)
    bad = _seeded(0)
    with torch.no_grad():
        bad.experts[1].weight.mul_(rank + 1)  # differs on every rank but rank 0
    out["sync"] = _failure(lambda: sp.save(path, {"model": bad}))
    out["async"] = _failure(lambda: sp.async_save(path, {"model": bad}))
    # The digests are of the state at the call: values that agree only after it returns still fail ...
    late = _seeded(0)
    with torch.no_grad():
        late.experts[1].weight.add_(rank)
    h = sp.async_save(path, {"model": late})
    with torch.no_grad():
        late.experts[1].weight.sub_(rank)
    out["fixed_after_call"] = _failure(lambda: h)
    dist.barrier()
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        out["manifest_kept"] = f.read() == manifest
    out["files_kept"] = _files(path) == files  # the failed saves' data files are gone
    back = _seeded(5)
    sp.load(path, {"model": back})
    out["kept"] = _same(good.state_dict(), back.state_dict())
    # ... and values that differ only after it returns were saved as they were at the call.
    drift = _seeded(0)
    h = sp.async_save(os.path.join(root, "drift"), {"model": drift})
    with torch.no_grad():
        drift.experts[0].weight.add_(rank)
    out["drift"] = _failure(lambda: h)
    back = _seeded(6)
    sp.load(os.path.join(root, "drift"), {"model": back})
    out["drift_loaded"] = _same(_seeded(0).state_dict(), back.state_dict())
    # A saver's repeated saves reuse the checked plan; the values are still compared each time.
    saver, model = sp.AsyncSaver(), _seeded(0)
    for _ in range(2):
        saver.save(os.path.join(root, "reuse"), {"model": model}).wait()
    with torch.no_grad():
        model.bias.add_(rank)
    out["reused"] = _failure(lambda: saver.save(os.path.join(root, "reuse"), {"model": model}))
    saver.close()
    _lazy_cases(out, root, rank)
    # Whether groups are declared decides whether the check gathers before the write: ranks must agree on it.
    try:
        sp.save(os.path.join(root, "disagree"), {"model": good}, replicated_over=list(range(world)) if rank == 0 else None)
        out["disagree"] = []
    except sp.CheckpointError as e:
        out["disagree"] = [type(e).__name__, str(e)]
    return out


def _lazy_cases(out: dict, root: str, rank: int) -> None:
    """A lazy save digests what it copies lazily on its worker, never on the training thread, and still refuses."""
    import threading

    from shardpoint.saving import replicas

    real, seen = replicas.digest_all, []

    def recording(tensors, host=True):
        seen.append((threading.current_thread().name, len(tensors)))
        return real(tensors, host)

    replicas.digest_all = recording
    try:
        model = _seeded(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt, 1)
        with torch.no_grad():
            model.experts[0].weight.add_(rank)  # differs on every rank but rank 0
        h = sp.async_save(os.path.join(root, "lazy"), {"model": model, "optimizer": opt}, mode="lazy")
        _step(model, opt, 2)  # the fence
        out["lazy"] = _failure(lambda: h)
        out["lazy_threads"] = sorted((name.split("_")[0], n) for name, n in seen if n)
        # A lazily digested tensor changed outside step() before the fence, on one rank: the guard refuses the save.
        h = sp.async_save(os.path.join(root, "lazy_torn"), {"model": _seeded(0)}, mode="lazy")
        h.wait()
        model = _seeded(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = sp.async_save(os.path.join(root, "lazy_torn"), {"model": model, "optimizer": opt}, mode="lazy")
        if rank == 0:
            with torch.no_grad():
                model.dense.weight.mul_(2.0)
        out["lazy_torn"] = _failure(lambda: h)
    finally:
        replicas.digest_all = real
    out["lazy_torn_names"] = sorted(sp.read_manifest(os.path.join(root, "lazy_torn"), chunks=False).tensors)


__all__ = ["Moe", "per_rank_job", "groups_job", "commit_job"]
