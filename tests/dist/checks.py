"""Checks shared by the multi-process reshard tests: in the ranks, and in the parent."""

from __future__ import annotations

import json
import os


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
