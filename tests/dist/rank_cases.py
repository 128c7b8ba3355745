"""Rank code for test_ranks: who takes part in a call, and what happens when ranks disagree.

One process group of 3 gloo ranks runs every check in turn:

- ``local``: rank 0 saves, loads, reads and async-saves with
  ``process_group=sp.LOCAL`` while ranks 1 and 2 wait in a plain
  ``dist.barrier``; then all continue, and all load what rank 0 saved;
- ``dtensor``: rank-local saves of DTensors: a replicated one is saved whole,
  a sharded one (FSDP2) raises a typed error naming it;
- ``subset``: ranks 0 and 1 save, load and async-save over a group of their
  own while rank 2 waits in a barrier;
- ``disagree``: ranks in different calls raise ``DistributedError`` within the
  short timeout, every rank that is in a shardpoint call, with the message
  naming both sides; afterwards the group still works;
- ``everything``: a non-strict load into an empty dict returns every entry.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=64, dim=16, heads=2, layers=2, seq=8)
SHORT = 3.0  # seconds: the collective timeout these checks use


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except sp.CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"type": None, "message": "", "seconds": time.monotonic() - t0}


def _local(rank: int, root: str, model, opt) -> dict:
    out: dict = {}
    path, apath = os.path.join(root, "local"), os.path.join(root, "local_async")
    if rank == 0:
        ref = full_state(model, opt)
        state = {"model": model, "optimizer": opt, "extra": {"step": 1}}
        sp.save(path, state, process_group=sp.LOCAL)
        m2, o2 = build("single", CFG, seed=5)
        got = sp.load(path, {"model": m2, "optimizer": o2, "extra": {}}, process_group=sp.LOCAL)
        out["load_equal"] = _equal(ref, full_state(m2, o2)) and got["extra"] == {"step": 1}
        out["read_equal"] = torch.equal(sp.read_tensor(path, "model.head.weight"), ref["model.head.weight"])
        sp.async_save(apath, state, process_group=sp.LOCAL).wait()
        out["async_world"] = sp.read_manifest(apath, chunks=False).world_size
    dist.barrier()  # ranks 1 and 2 wait here all along
    # Both checkpoints are ordinary ones: every rank loads them, collectively.
    for p in (path, apath):
        m3, o3 = build("single", CFG, seed=6)
        sp.load(p, {"model": m3, "optimizer": o3, "extra": {}})
        out[f"all_load_{os.path.basename(p)}"] = _equal(full_state(model, opt), full_state(m3, o3))
    return out


def _dtensor(rank: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp, _ = build("fsdp2", CFG, seed=2)
    rep = DTensor.from_local(torch.arange(12.0).reshape(3, 4), mesh, [Replicate()], run_check=False)
    out: dict = {}
    full = os.path.join(root, "fsdp")
    sp.save(full, {"model": fsdp})  # collective
    ref = {n: p._local_tensor.clone() for n, p in fsdp.named_parameters()}
    if rank == 1:
        # A rank-local load fills this rank's own shards, with no collective.
        with torch.no_grad():
            for p in fsdp.parameters():
                p._local_tensor.zero_()
        out["zeroed"] = all(not bool(fsdp.get_parameter(n)._local_tensor.any()) for n in ref)
        sp.load(full, {"model": fsdp}, process_group=sp.LOCAL)
        out["local_shard_load"] = all(torch.equal(p._local_tensor, ref[n]) for n, p in fsdp.named_parameters())
        path = os.path.join(root, "rep")
        sp.save(path, {"w": rep}, process_group=sp.LOCAL)
        out["replicated"] = torch.equal(sp.read_tensor(path, "w"), torch.arange(12.0).reshape(3, 4))
        out["sharded"] = _error(lambda: sp.save(os.path.join(root, "shard"), {"model": fsdp}, process_group=sp.LOCAL))
        out["sharded_left_nothing"] = not os.path.exists(os.path.join(root, "shard", "manifest.json"))
    dist.barrier()
    return out


def _subset(rank: int, root: str, model, opt) -> dict:
    sub = dist.new_group([0, 1])  # made by every rank, used by ranks 0 and 1 only
    out: dict = {}
    if rank < 2:
        path, apath = os.path.join(root, "sub"), os.path.join(root, "sub_async")
        state = {"model": model, "optimizer": opt}
        sp.save(path, state, process_group=sub, collective_timeout=SHORT * 10)
        h = sp.async_save(apath, state, process_group=sub, collective_timeout=SHORT * 10)
        h.wait()
        for p in (path, apath):
            m2, o2 = build("single", CFG, seed=9)
            sp.load(p, {"model": m2, "optimizer": o2}, process_group=sub)
            out[f"equal_{os.path.basename(p)}"] = _equal(full_state(model, opt), full_state(m2, o2))
        out["world"] = sp.read_manifest(path, chunks=False).world_size
    dist.barrier()  # rank 2 waits here all along
    return out


def _disagree(rank: int, root: str, model) -> dict:
    a, b, c = (os.path.join(root, n) for n in ("dis_a", "dis_b", "dis_c"))
    state = {"model": model}
    sp.save(b, state)  # something to load
    out: dict = {}
    # 1. Rank 1 loads while ranks 0 and 2 save.
    out["save_vs_load"] = _error(
        (lambda: sp.load(b, {"model": model}, collective_timeout=SHORT)) if rank == 1 else (lambda: sp.save(a, state, collective_timeout=SHORT))
    )
    # 2. Rank 0 saves while ranks 1 and 2 wait in a plain barrier; then all continue.
    if rank == 0:
        out["save_vs_barrier"] = _error(lambda: sp.save(a, state, collective_timeout=SHORT))
    dist.barrier()
    # 3. Same call, different paths.
    out["paths"] = _error(lambda: sp.save(c if rank == 2 else a, state, collective_timeout=SHORT))
    # 4. The group is in step again: a save and a load that agree just work.
    sp.save(a, state, collective_timeout=SHORT)
    sp.load(a, {"model": model}, collective_timeout=SHORT)
    out["recovered"] = sp.read_manifest(a, chunks=False).world_size
    out["nothing_committed"] = not os.path.exists(os.path.join(c, "manifest.json"))
    return out


def _disagree_async(rank: int, root: str, state: dict) -> dict:
    """Async saves post their entry at the call and wait for the other ranks in the background."""
    d, e, f = (os.path.join(root, n) for n in ("dis_async_d", "dis_async_e", "dis_async_f"))
    out: dict = {}
    saver = sp.AsyncSaver()
    try:
        saver.prewarm()  # the private group exists: the call itself makes no collective
        if rank == 1:
            time.sleep(1.0)  # arrives late: the others' calls do not wait for it
        t0 = time.monotonic()
        h = saver.save(d, state, collective_timeout=SHORT)
        out["call_s"] = time.monotonic() - t0
        out["committed"] = h.wait().path.endswith("dis_async_d") and sp.read_manifest(d, chunks=False).world_size
        t0 = time.monotonic()
        h = saver.save(f if rank == 2 else e, state, mode="lazy", collective_timeout=SHORT)
        out["paths_call_s"] = time.monotonic() - t0
        out["paths"] = _error(h.wait)
        out["paths_nothing_committed"] = not any(os.path.exists(os.path.join(p, "manifest.json")) for p in (e, f))
        out["recovered"] = saver.save(d, state, collective_timeout=SHORT).wait().path.endswith("dis_async_d")
    finally:
        saver.close()
    return out


def _everything(rank: int, root: str, model, opt) -> dict:
    path = os.path.join(root, "all")
    h = torch.tensor([1.5, -2.0])
    sp.save(path, {"model": model, "optimizer": opt, "extra": {"step": 3, "betas": (0.9, 0.95), "h": h}})
    got = sp.load(path, {}, strict=False)
    ref = full_state(model, opt)
    ok_model = _equal({f"model.{k}": v for k, v in got["model"].items()}, {k: v for k, v in ref.items() if k.startswith("model.")})
    names = {id(p): n for n, p in model.module.named_parameters()}
    ok_opt = all(
        torch.equal(got["optimizer"]["state"][f"model.{names[id(p)]}"][k], v)
        for p, st in opt.state.items() for k, v in st.items()
    )
    return {
        "keys": sorted(got),
        "model": ok_model,
        "optimizer": ok_opt and got["optimizer"]["groups"][0]["lr"] == opt.param_groups[0]["lr"],
        "extra": got["extra"]["step"] == 3 and got["extra"]["betas"] == (0.9, 0.95) and torch.equal(got["extra"]["h"], h),
    }


def ranks_job(rank: int, world: int, root: str) -> dict:
    model, opt = build("ddp", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    return {
        "local": _local(rank, root, model, opt),
        "dtensor": _dtensor(rank, root),
        "disagree_async": _disagree_async(rank, root, {"model": model}),  # before any subset group: new groups stay in step
        "subset": _subset(rank, root, model, opt),
        "disagree": _disagree(rank, root, model),
        "everything": _everything(rank, root, model, opt),
    }
