"""A run root's folders: one folder per step, its lock and the ``latest`` hint, and listing them.

::

    run/
      latest                 hint only ("step_00000300"); never read back
      step_00000200/         manifest.json + data/ (a normal shardpoint checkpoint)
      step_00000300/.lock    a save in progress (or one that crashed before committing)

A step is complete exactly when its ``manifest.json`` exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..format.manifest import MANIFEST_NAME
from ..storage import Storage

__all__ = ["LOCK_NAME", "HINT_NAME", "STEP_PATTERN", "step_folder", "StepFolder", "scan_steps", "committed_steps"]

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


def scan_steps(storage: Storage) -> dict[int, StepFolder]:
    """Every step folder under a run root, by step, from one listing.

    Example::

        folders = scan_steps(LocalStorage("ckpt/run"))
        torn = [s for s, f in folders.items() if not f.committed]
    """
    out: dict[int, StepFolder] = {}
    for name in storage.list(""):
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


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest is committed, oldest first.

    Example::

        committed_steps(LocalStorage("ckpt/run"))  # [300, 400, 500]
    """
    return sorted(s for s, f in scan_steps(storage).items() if f.committed)
