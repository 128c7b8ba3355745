"""A run root's folders, listed from its storage; the names themselves are :mod:`shardpoint.format.folders`.

::

    run/
      latest                 hint only ("step_00000300"); never read back
      step_00000200/         manifest.json + data/ (a normal shardpoint checkpoint)
      step_00000300/.lock    a save in progress (or one that crashed before committing)

A step is complete exactly when its ``manifest.json`` exists.
"""

from __future__ import annotations

from ..format.folders import HINT_NAME, LOCK_NAME, STEP_PATTERN, StepFolder, committed_in, step_folder, steps_in
from ..storage import Storage

__all__ = ["LOCK_NAME", "HINT_NAME", "STEP_PATTERN", "step_folder", "StepFolder", "scan_steps", "committed_steps"]


def scan_steps(storage: Storage) -> dict[int, StepFolder]:
    """Every step folder under a run root, by step, from one listing.

    Example::

        folders = scan_steps(LocalStorage("ckpt/run"))
        torn = [s for s, f in folders.items() if not f.committed]
    """
    return steps_in(storage.list(""))


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest is committed, oldest first.

    Example::

        committed_steps(LocalStorage("ckpt/run"))  # [300, 400, 500]
    """
    return committed_in(storage.list(""))
