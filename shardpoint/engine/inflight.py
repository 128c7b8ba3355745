"""Saves still running in this process, by checkpoint path, so that a load of that path waits for them.

An asynchronous save returns before its checkpoint is committed. Whoever
loads the same path next in the same process (another saver, another
framework plugin, a new trainer) waits here until that save has finished,
committed or failed, instead of finding a folder still being written. The
load then reads whatever the path holds: the new checkpoint, or the previous
one if the save failed (the save's error is its owner's to raise).

This is process-wide state, by necessity: the saver and the loader need not
know each other. Saves in other processes are not seen here; their commit
protocol (claim, manifest written last) keeps them safe.

Example::

    done = threading.Event()
    track_save("ckpt/step_100", done)   # by the saver, before it returns
    wait_for_saves("ckpt/step_100")     # by a loader: returns once done.set() ran
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

__all__ = ["path_key", "track_save", "wait_for_saves", "saves_in_flight", "saving"]

# Process-wide on purpose: a load or save of a path waits for every save of it in this process, whoever started it.
# Keyed by the path as the save spelled it; resolved (path_key) only when looked up, so that a save's call
# stays free of filesystem work (resolving a path makes a system call per component).
_lock = threading.Lock()
_running: dict[str, list[threading.Event]] = {}


def path_key(path: str) -> str:
    """The key one checkpoint location has here, however its path was spelled.

    Local paths (``file://`` included) become absolute and resolved; storage
    URLs lose a trailing slash.

    Example::

        assert path_key("ckpt/a/") == path_key(os.path.abspath("ckpt/a"))
    """
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/")
    local = text[len("file://"):] if text.startswith("file://") else text
    return os.path.realpath(local)


def track_save(path: str, finished: threading.Event) -> None:
    """Record a save to ``path`` that is running until ``finished`` is set (set it on success and failure alike).

    Example::

        track_save(handle.path, finished_event)
    """
    spelled = _spelling(path)  # resolved when looked up: the save's call makes no filesystem round trip
    with _lock:
        live = [e for e in _running.get(spelled, ()) if not e.is_set()]
        live.append(finished)
        _running[spelled] = live
        _prune()


def _spelling(path: str) -> str:
    """``path`` made absolute, not resolved (a later change of directory does not change what it names)."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text
    return os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)


def _live(key: str) -> list[threading.Event]:
    """The unfinished saves whose path, as spelled when tracked, resolves to ``key`` (call with the lock held)."""
    return [e for spelled, events in _running.items() if path_key(spelled) == key for e in events if not e.is_set()]


def saves_in_flight(path: str) -> int:
    """How many tracked saves to ``path`` are still running (never blocks).

    Example::

        if saves_in_flight("ckpt/last"): print("a save of ckpt/last is still being written")
    """
    with _lock:
        return len(_live(path_key(path)))


def wait_for_saves(path: str, timeout: float | None = None) -> bool:
    """Block until every tracked save to ``path`` has finished; ``False`` if ``timeout`` ran out first.

    Example::

        wait_for_saves("ckpt/last.ckpt")
        state = sp.load("ckpt/last.ckpt", {}, strict=False)
    """
    key = path_key(path)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            live = _live(key)
            if not live:
                _prune()
                return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        live[0].wait(left)


@contextlib.contextmanager
def saving(path: str) -> Iterator[None]:
    """Track a synchronous save to ``path`` for as long as the ``with`` block runs.

    Example::

        with saving(path):
            sp.save(path, state)
    """
    done = threading.Event()
    track_save(path, done)
    try:
        yield
    finally:
        done.set()


def _prune() -> None:
    for key in [k for k, events in _running.items() if all(e.is_set() for e in events)]:
        del _running[key]
