"""A run root's folder names: one folder per step, its lock and the ``latest`` hint.

::

    run/
      latest                 hint only ("step_00000300"); never read back
      step_00000200/         manifest.json + data/ (a normal shardpoint checkpoint)
      step_00000300/.lock    a save in progress (or one that crashed before committing)

A step is complete exactly when its ``manifest.json`` exists. These are facts
of the layout only: :func:`steps_in` reads them from a listing someone else
made (:mod:`shardpoint.manager.folders` lists a storage; a failed load lists
a folder to say what it is). Example::

    steps = steps_in(["step_00000200/manifest.json", "step_00000300/.lock"])
    assert steps[200].committed and steps[300].locked
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from .manifest import MANIFEST_NAME

__all__ = ["LOCK_NAME", "HINT_NAME", "STEP_PATTERN", "step_folder", "StepFolder", "steps_in", "committed_in"]

LOCK_NAME = ".lock"
"""Exclusive per-step lock object, held from the start of a save until it commits."""
HINT_NAME = "latest"
"""A human-readable hint naming the newest step folder; never trusted by the manager."""
STEP_PATTERN = re.compile(r"^step_(\d{8,})$")
"""The name of a step folder; its group is the step number."""


def step_folder(step: int) -> str:
    """The folder name of ``step``: ``step_`` and at least 8 digits (sorts by name and number).

    Example::

        step_folder(100)  # 'step_00000100'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


@dataclass
class StepFolder:
    """What a listing found in one step folder: a committed manifest, a lock, or neither."""

    step: int
    name: str
    committed: bool = False
    locked: bool = False


def steps_in(names: Iterable[str]) -> dict[int, StepFolder]:
    """Every step folder among the object names of one listing of a run root, by step.

    Example::

        steps_in(["step_00000200/manifest.json", "notes.txt"])  # {200: StepFolder(200, 'step_00000200', True)}
    """
    out: dict[int, StepFolder] = {}
    for name in names:
        top, _, rest = name.partition("/")
        m = STEP_PATTERN.match(top)
        if not m or not rest:
            continue
        f = out.setdefault(int(m.group(1)), StepFolder(int(m.group(1)), top))
        if rest == MANIFEST_NAME:
            f.committed = True
        elif rest == LOCK_NAME:
            f.locked = True
    return out


def committed_in(names: Iterable[str]) -> list[int]:
    """Steps whose manifest is among ``names`` (one listing of a run root), oldest first.

    Example::

        committed_in(["step_00000300/manifest.json", "step_00000200/manifest.json"])  # [200, 300]
    """
    return sorted(s for s, f in steps_in(names).items() if f.committed)
