"""Rank code for test_dcp_optim: DCP and shardpoint exchange model AND optimizer under FSDP2.

One process group of 2 gloo ranks. A TinyGPT under FSDP2 trains 2 steps; its
model and AdamW state then travel every way between DCP and shardpoint:

1. ``dcp.save`` of ``get_model_state_dict``/``get_optimizer_state_dict`` ->
   ``shardpoint import dcp`` (rank 0) -> ``sp.load`` into a fresh FSDP2 model;
2. ``sp.save`` -> ``shardpoint export --to dcp`` (rank 0) -> ``dcp.load`` into
   the dicts of ``get_model_state_dict``/``get_optimizer_state_dict`` of a
   fresh model, then ``set_model_state_dict``/``set_optimizer_state_dict``;
3. ``sp.save`` of the DCP-keyed dicts themselves -> ``sp.load`` into a fresh
   model and optimizer (the load-time naming view).

Each restore is compared tensor for tensor (bit-exact, ``step`` included)
with the trained state, and its next two steps' losses with the run that
never stopped.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=64, dim=16, heads=2, layers=2, seq=8)
TRAINED = 2  # steps before the checkpoint
NEXT = 2  # steps compared after the restore


def _diff(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (or exist on one side only); [] when bit-exact."""
    out = sorted(set(a) ^ set(b))
    out += [k for k in sorted(set(a) & set(b)) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return out


def _continue(model, opt) -> list[float]:
    return [train_step(model, opt, TRAINED + i, CFG) for i in range(NEXT)]


def dcp_job(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from shardpoint.cli import main

    warnings.filterwarnings("ignore")
    model, opt = build("fsdp2", CFG, seed=0)
    for s in range(TRAINED):
        train_step(model, opt, s, CFG)
    ref = full_state(model, opt)
    steps = sorted({float(v) for k, v in ref.items() if k.endswith(".step")})
    out: dict = {"ref_steps": steps, "ref_tensors": len(ref)}

    dcp_in, ck_in = os.path.join(root, "dcp_in"), os.path.join(root, "from_dcp")
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=dcp_in)
    ck_out, dcp_out = os.path.join(root, "sp"), os.path.join(root, "dcp_out")
    sp.save(ck_out, {"model": model, "optimizer": opt})
    ck_keyed = os.path.join(root, "keyed")
    sp.save(ck_keyed, {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)})
    if rank == 0:
        out["rc"] = [
            main(["import", "dcp", dcp_in, ck_in, "--allow-pickle", "-q"]),
            main(["export", ck_out, "--to", "dcp", dcp_out, "-q"]),
        ]
        m = sp.read_manifest(ck_in, chunks=False)
        out["imported_names"] = sorted(n for n in m.tensors if n.startswith("optimizer."))
        out["keyed_names"] = sorted(n for n in sp.read_manifest(ck_keyed, chunks=False).tensors if n.startswith("optimizer."))
    dist.barrier()
    out["uninterrupted"] = _continue(model, opt)

    # 1. DCP -> shardpoint.
    m1, o1 = build("fsdp2", CFG, seed=11)
    sp.load(ck_in, {"model": m1, "optimizer": o1})
    out["import_diff"] = _diff(ref, full_state(m1, o1))
    out["import_next"] = _continue(m1, o1)

    # 2. shardpoint -> DCP, restored by DCP's own helpers.
    m2, o2 = build("fsdp2", CFG, seed=22)
    sd = {"model": get_model_state_dict(m2), "optimizer": get_optimizer_state_dict(m2, o2)}
    dcp.load(sd, checkpoint_id=dcp_out)
    set_model_state_dict(m2, sd["model"])
    set_optimizer_state_dict(m2, o2, sd["optimizer"])
    out["export_diff"] = _diff(ref, full_state(m2, o2))
    out["export_next"] = _continue(m2, o2)

    # 3. A checkpoint keyed the DCP way, loaded straight into the optimizer.
    m3, o3 = build("fsdp2", CFG, seed=33)
    sp.load(ck_keyed, {"model": m3, "optimizer": o3})
    out["keyed_diff"] = _diff(ref, full_state(m3, o3))
    out["keyed_next"] = _continue(m3, o3)
    return out
