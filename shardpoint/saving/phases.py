"""The phases of one rank's asynchronous save, and which moves between them are legal.

A save only moves forward, through each phase at most once::

    COPYING -> QUEUED -> COPIED -> FENCED -> WRITTEN -> COMMITTED | FAILED
       |          |         |                   ^
       |          |         +-------------------+  (an eager save has no fence)
       +----------+-----------------------------+  (the write failed, or it outran
                                                     the copy report of an eager save)

``QUEUED`` is a lazy save's: every copy is queued on the device, so an
optimizer step can be ordered after them. ``FENCED`` is a lazy save's too:
its guard's verdict was taken at the fence, after the copies were complete
(on an asynchronous device its comparisons may still run there; the commit
reads the verdict first). The
copies' reports come from other threads than the writer's, so a copy report
may arrive after the writer has moved on (its write failed, or an eager
save's writer finished the streamed copy before the training thread reported
it): such a late report is recorded and changes nothing.
:func:`advance` is the whole table, as a pure function.

Example::

    phase = advance(SavePhase.COPYING, {SavePhase.COPYING}, SavePhase.COPIED)
"""

from __future__ import annotations

import enum
from typing import Collection

from ..errors import CheckpointError

__all__ = ["SavePhase", "IllegalTransitionError", "advance"]


class SavePhase(enum.Enum):
    """Where one rank's asynchronous save is (see :attr:`AsyncSaveHandle.state <shardpoint.AsyncSaveHandle.state>`).

    Example::

        if handle.state is SavePhase.FAILED: handle.wait()  # raises the failure
    """

    COPYING = "copying"  # the snapshot's copies run
    QUEUED = "queued"  # lazy: every copy is queued; a step can be ordered after them on the device
    COPIED = "copied"  # every copy is complete (or failed): the fence may pass
    FENCED = "fenced"  # lazy: the guard's verdict was taken at the fence; the commit, reading it first, may follow
    WRITTEN = "written"  # this rank's write phase ended (written or failed); the commit runs
    COMMITTED = "committed"
    FAILED = "failed"

    @property
    def order(self) -> int:
        """The phase's place in the save: a save moves to higher orders only."""
        return _ORDER[self]

    @property
    def terminal(self) -> bool:
        """Whether nothing more happens in the background (committed or failed)."""
        return self in (SavePhase.COMMITTED, SavePhase.FAILED)


_P = SavePhase
_ORDER = {_P.COPYING: 0, _P.QUEUED: 1, _P.COPIED: 2, _P.FENCED: 3, _P.WRITTEN: 4, _P.COMMITTED: 5, _P.FAILED: 5}
_LEGAL: dict[SavePhase, frozenset[SavePhase]] = {  # phase -> the phases it may be entered from
    _P.QUEUED: frozenset({_P.COPYING}),
    _P.COPIED: frozenset({_P.COPYING, _P.QUEUED}),
    _P.FENCED: frozenset({_P.COPIED}),
    _P.WRITTEN: frozenset({_P.COPYING, _P.QUEUED, _P.COPIED, _P.FENCED}),
    _P.COMMITTED: frozenset({_P.WRITTEN}),
    _P.FAILED: frozenset({_P.WRITTEN}),
}
# Copy reports come from the copying threads: the writer may have moved on first.
_LATE_OK: dict[SavePhase, frozenset[SavePhase]] = {
    _P.QUEUED: frozenset({_P.WRITTEN, _P.COMMITTED, _P.FAILED}),
    _P.COPIED: frozenset({_P.WRITTEN, _P.COMMITTED, _P.FAILED}),
}


class IllegalTransitionError(CheckpointError):
    """An asynchronous save was told of a phase it cannot enter from where it is (a scheduling bug).

    Example::

        advance(SavePhase.COPYING, {SavePhase.COPYING}, SavePhase.COMMITTED)  # raises
    """


def advance(current: SavePhase, seen: Collection[SavePhase], to: SavePhase, path: str = "") -> SavePhase:
    """The phase after the report ``to`` in ``current`` (``seen``: every phase reported so far).

    Returns ``to`` for a legal move, ``current`` for a late copy report,
    and raises :class:`IllegalTransitionError` for a phase reported twice
    or entered from a phase it cannot follow.

    Example::

        advance(SavePhase.WRITTEN, {SavePhase.COPYING, SavePhase.WRITTEN}, SavePhase.COPIED)  # WRITTEN
    """
    where = f"save to {path}" if path else "save"
    if to in seen:
        raise IllegalTransitionError(
            f"{where}: phase {to.name} reported twice (now {current.name}); each phase is entered once. "
            "This is a bug in the save's scheduling: please report it with the log")
    if current in _LEGAL.get(to, ()):
        return to
    if current in _LATE_OK.get(to, ()):
        return current
    allowed = ", ".join(sorted(p.name for p in _LEGAL.get(to, ()))) or "nowhere"
    raise IllegalTransitionError(
        f"{where}: cannot enter {to.name} from {current.name} (only from {allowed}). "
        "This is a bug in the save's scheduling: please report it with the log")
