"""The manager's constructor arguments: checked once, with the old spellings still accepted for a release."""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from .policies import EveryNSteps, SavePolicy

__all__ = ["MODES", "UNSET", "resolve_mode", "save_policies", "check_arguments"]

MODES = ("eager", "lazy", None)
"""The manager's ``mode`` values: background saves (``"eager"``, ``"lazy"``) or blocking ones (``None``)."""

UNSET: Any = object()
"""The default of ``mode`` and ``async_mode``: tells "not given" apart from ``None`` (blocking saves)."""


def resolve_mode(mode: Any, async_mode: Any) -> str | None:
    """The save mode from ``mode=`` or the deprecated ``async_mode=`` (with a ``DeprecationWarning``).

    ``UNSET`` for both gives the default, ``"eager"``.

    Example::

        resolve_mode("lazy", UNSET)  # 'lazy'
    """
    if async_mode is not UNSET:
        if mode is not UNSET:
            raise ValueError("give mode= only: async_mode= is its deprecated old name")
        warnings.warn(
            "CheckpointManager(async_mode=...) is deprecated; use mode=... (the same values: 'eager', 'lazy' or None)",
            DeprecationWarning, stacklevel=3,
        )
        mode = async_mode
    mode = "eager" if mode is UNSET else mode
    if mode not in MODES:
        raise ValueError(f"mode must be 'eager', 'lazy' or None (blocking saves), got {mode!r}")
    return mode


def save_policies(interval: int | None, policies: Sequence[SavePolicy], memory: Any = None) -> list[SavePolicy]:
    """The manager's save policies; a manager with none would never save, so that is refused.

    A :class:`~shardpoint.PeerMemory` saves at its own interval, so with
    ``memory`` no storage policy is needed.

    Example::

        save_policies(100, [])  # [EveryNSteps(100)]
    """
    if interval is not None and (isinstance(interval, bool) or int(interval) < 1):
        raise ValueError(
            f"interval must be a number of steps >= 1, got {interval!r}: interval=0 would never save. Give "
            "interval=N to save every N steps, or policies=[...] (EveryTSeconds(s), or OnDemand() to save "
            "only when you call save() or request_save())"
        )
    out = ([EveryNSteps(int(interval))] if interval is not None else []) + list(policies)
    if not out and memory is None:
        raise ValueError(
            "CheckpointManager needs a save policy, or it would never save: give interval=N (save every N "
            "steps), or policies=[EveryTSeconds(seconds)], or policies=[OnDemand()] to save only when you "
            "call mgr.save(step, state) or request_save() (also the choice for a manager that only restores)"
        )
    return out


def check_arguments(keep_last: Any, keep_every: Any, timeout: Any, on_hang: Any) -> None:
    """Refuse retention counts below 1, a timeout <= 0 and an unknown ``on_hang``.

    Example::

        check_arguments(3, None, 1800.0, "auto")
    """
    if keep_last is not None and int(keep_last) < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every is not None and int(keep_every) < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 or None, got {timeout}")
    if isinstance(on_hang, str) and on_hang not in ("auto", "exit", "raise", "log"):
        raise ValueError(f"on_hang must be 'auto', 'exit', 'raise', 'log' or a callable, got {on_hang!r}")
