"""What a load did on one rank: :class:`LoadResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.monitor import Recorder

__all__ = ["LoadResult"]


@dataclass
class LoadResult:
    """What a load did on this rank; ``missing``/``unexpected`` are filled under ``strict=False``.

    ``not_restored`` names tensors read from the checkpoint that did not reach
    the live state (a strict load raises :class:`StateNotRestoredError` instead).

    ``bytes_read`` counts tensor data; ``index_bytes`` the index files
    (format version 2) this rank read to find it. ``timings`` holds seconds
    per phase: ``manifest``, ``prepare`` (targets from the state), ``index``,
    ``plan``, ``read`` (the whole read phase), ``landing`` (proving that the
    state landed, after the objects installed it), and within ``read`` ``verify``,
    ``copy``, ``wait`` (the loading thread idle until a read lands) and
    ``communicate``; phases that run in reader threads add up over threads.
    ``state`` is the loaded state (what :func:`load` returns).

    Example::

        res = sp.load("ckpt/step_100", state, return_result=True)
        print(res.bytes_read, res.timings["read"], res.state is state)
    """

    path: str = ""
    bytes_read: int = 0
    index_bytes: int = 0
    bytes_needed: int = 0
    bytes_received: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    recorder: Recorder | None = field(default=None, repr=False)
    state: Any = field(default=None, repr=False)
