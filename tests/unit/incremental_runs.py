"""A manager run of incremental saves, and what its run folder must then hold; shared by the local and S3 tests."""

from __future__ import annotations

import torch

import shardpoint as sp
from shardpoint.manager.incremental import referenced_by


def four_steps_keep_last_one(run, st: dict, mgr) -> None:
    """Four saves by ``mgr`` (``keep_last=1``, incremental) into ``run``, changing only the adapter; then check the run.

    Kept: the first step's data, which the last step references, and the
    last step, which loads bit for bit.
    """
    try:
        for step in range(1, 5):
            st["model"]["adapter"].add_(1)
            mgr.save(step, st)
            mgr.wait()
    finally:
        mgr.close()
    folders = sorted({n.split("/")[0] for n in run.list("") if n.startswith("step_")})
    assert folders == ["step_00000001", "step_00000004"]
    assert run.child("step_00000001").list("") == sorted(referenced_by(run, [4])["step_00000001"])
    out = sp.load(run.child("step_00000004"), {}, strict=False)
    assert torch.equal(out["model"]["frozen"], st["model"]["frozen"]) and torch.equal(out["model"]["adapter"], st["model"]["adapter"])
