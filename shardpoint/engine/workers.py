"""The asynchronous saver's worker threads: a fixed pool, started ahead and run at a lower priority.

Two long-lived workers (the writer and the lazy copier) serve every save: a
thread started inside a save waits for the GIL, which costs the training
loop milliseconds. :func:`start_workers` starts them all at once, so a
pre-warmed saver's first save finds them running.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading

__all__ = ["nice_target", "lower_priority", "start_workers"]

log = logging.getLogger("shardpoint")


def nice_target(delta: int) -> int | None:
    """The nice level ``delta`` levels below the calling thread's, or None to leave priorities alone.

    Example::

        nice_target(0)  # None
    """
    if delta <= 0 or not hasattr(os, "setpriority"):
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + delta)
    except OSError:
        return None


def lower_priority(target: int | None) -> None:
    """Run the calling thread at nice level ``target`` unless it is already that low (Linux threads only)."""
    if target is None:
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:  # not permitted, or not a per-thread scheduler: run at normal priority
        log.debug("could not lower the save workers' priority: %s", e)


def start_workers(count: int, nice: int, name: str = "shardpoint-save", started: bool = True) -> cf.ThreadPoolExecutor:
    """A pool of ``count`` threads running ``nice`` levels below the caller; with ``started`` they all run on return.

    The target level is fixed here, on the caller's thread: a worker may be
    started by another worker (the lazy copier starts the writer), and a
    relative change there would stack (+5 on +5).

    Example::

        pool = start_workers(2, 5); pool.submit(print, "hi"); pool.shutdown()
    """
    pool = cf.ThreadPoolExecutor(max_workers=count, thread_name_prefix=name, initializer=lower_priority, initargs=(nice_target(nice),))
    if started:
        # One task per thread, each held until all are running: the pool must start a thread for each.
        gate = threading.Barrier(count)
        for f in [pool.submit(gate.wait, 30.0) for _ in range(count)]:
            f.result()
    return pool
