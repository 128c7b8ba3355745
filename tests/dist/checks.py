"""Checks shared by the multi-process reshard tests.

In the ranks: the reference a saving run records and what a load gives
compared with it; in the parent: what the ranks returned.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def write_reference(root: str, name: str, ref: dict[str, torch.Tensor], losses: list[float]) -> None:
    """Record a saving run: its full state at the save (``<name>.ref.safetensors``) and the losses of the steps after it."""
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(root, f"{name}.ref.safetensors"))
    with open(os.path.join(root, f"{name}.losses.json"), "w") as f:
        json.dump(losses, f)


def check_reference(root: str, name: str, got: dict[str, torch.Tensor], label: str) -> None:
    """``got`` is the saving run's full state (:func:`write_reference`) bit for bit: the same names, dtypes, shapes and values."""
    ref = load_file(os.path.join(root, f"{name}.ref.safetensors"))
    assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))
    bad = [k for k in ref if got[k].dtype != ref[k].dtype or got[k].shape != ref[k].shape or not torch.equal(got[k], ref[k])]
    assert not bad, f"{label}: not bit-exact: {bad[:5]}"


def load_record(losses: list[float], report) -> dict:
    """What a load job returns for one case: the losses after the load and the bytes it read (a ``LoadResult``)."""
    return {"losses": losses, "bytes_read": report.bytes_read, "bytes_needed": report.bytes_needed}


def check_continued_losses(root: str, name: str, losses: list[float], label: str) -> None:
    """The steps taken after a load match those the saving run took (``<name>.losses.json``)."""
    with open(os.path.join(root, f"{name}.losses.json")) as f:
        want = json.load(f)
    for a, b in zip(losses, want):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{label}: losses {losses} vs {want}"


def check_ranks_agree(results: list[dict], cases: list[list[str]], world: int) -> None:
    """Every rank ran every case, and all ranks saw the same losses (the layout reproduces the computation)."""
    import pytest

    for r in results:
        assert sorted(r) == sorted(f"{s}->{l}{world}" for s, l in cases)
    first = results[0]
    for k, v in first.items():
        for other in results[1:]:
            assert other[k]["losses"] == pytest.approx(v["losses"], rel=1e-5)
