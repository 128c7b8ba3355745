"""Fault injection for tests: a hook the manager calls at each phase, built from ``SHARDPOINT_FAULT``.

The crash and hang tests start real training processes and need them to die
or stall at a chosen point of a chosen save; the manager calls its fault hook
at ``decide``, ``lock``, ``snapshot``, ``write``, ``committed``,
``retention``, ``compact`` (incremental runs: each step of moving referenced
chunks) and ``restore``. Without ``SHARDPOINT_FAULT`` (and without a
``fault_hook`` argument) nothing is called.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Callable

__all__ = ["FAULT_ENV", "FaultHook", "fault_from_env"]

FAULT_ENV = "SHARDPOINT_FAULT"
"""Test-only fault injection, a JSON object or list of them: see :func:`fault_from_env`."""

FaultHook = Callable[[str, "int | None", int], None]
"""``hook(phase, step, rank)``, called by the manager as it enters each phase."""


def fault_from_env() -> FaultHook | None:
    """Test-only: build a fault hook from ``SHARDPOINT_FAULT``; ``None`` when it is unset.

    The variable holds a JSON object (or a list of them) with keys ``phase``
    (one of the manager's phases: ``decide``, ``lock``, ``snapshot``,
    ``write``, ``committed``, ``retention``, ``compact``, ``restore``), optional ``rank``,
    ``step`` (``null``/absent: any), ``delay`` (seconds; the action runs on a
    timer thread, landing at a random point of the work that follows),
    ``action`` (``"kill"``: SIGKILL this process, the default; ``"stall"``:
    sleep ``seconds`` in place), and ``nth`` (act on the n-th match, from 1).

    Example::

        os.environ[FAULT_ENV] = '{"phase": "write", "rank": 1, "step": 8}'
        hook = fault_from_env()   # SIGKILLs rank 1 as the save of step 8 starts writing
    """
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    specs = json.loads(raw)
    specs = specs if isinstance(specs, list) else [specs]
    counts = [0] * len(specs)

    def hook(phase: str, step: int | None, rank: int) -> None:
        for i, s in enumerate(specs):
            if s.get("phase") != phase:
                continue
            if s.get("rank") is not None and int(s["rank"]) != rank:
                continue
            if s.get("step") is not None and step != int(s["step"]):
                continue
            counts[i] += 1
            if counts[i] != int(s.get("nth", 1)):
                continue
            action = s.get("action", "kill")
            delay = float(s.get("delay", 0))
            if action == "stall":
                time.sleep(float(s.get("seconds", 3600)))
            elif action == "kill":
                def kill() -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

                if delay > 0:
                    threading.Timer(delay, kill).start()
                else:
                    kill()

    return hook
