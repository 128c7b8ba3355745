"""The entry handshake: every rank of a collective save or load agrees on what it is in.

Without it, ranks that disagree (rank 0 saves while rank 1 waits in a
barrier, or loads, or saves to another path) hang in the first collective
until the process group's own timeout, often 30 minutes, and then fail with
a backend error that names nothing. With it, each call first tells the
group what it is about to do (an *entry*: operation and path) and waits, up
to a timeout, until every rank has said the same thing. Disagreeing ranks
raise :class:`~shardpoint.errors.DistributedError` on every rank, naming
both sides; a rank that waits in vain raises it after the timeout.

The handshake runs on the process group's key-value store (the TCPStore
that ``init_process_group`` set up), not through a collective: a collective
that times out keeps running in the backend and leaves the group unusable,
and it would be paired with whatever collective the other rank is in (a
plain ``barrier``), breaking that one too. Store operations time out
cleanly and leave the other ranks' collectives alone, so after the error
the ranks can meet again (a barrier, the next save).

Protocol, per group, with a counter per rank in the store, in two halves so
that an asynchronous save can hand its entry over on the training thread
and wait for the others in the background:

- :func:`announce` (never waits): a rank takes its next *slot* ``k``,
  skipping slots that an earlier timeout abandoned before this rank got
  there. The first rank to arrive records its entry; each later one compares
  its own with it and posts the first disagreement (rank 0's entry is kept
  too: an error names it beside one that differs). The last rank to arrive
  marks the slot ``go``.
- :func:`await_entry`: wait until the slot goes; a rank whose wait times out
  marks it ``cancel`` instead. The store's compare-and-set makes exactly one
  of the two win, so either every rank proceeds or none does. Each rank then
  leaves the slot; the last to leave deletes its keys (a rank still waiting
  on a slot keeps it alive, however far its training thread has moved on).

Every rank compares before it counts itself in, so once a slot goes every
disagreement is posted. Cost: about ten store round trips per rank (well
under a millisecond on an idle host), half of them in each half.

Entries are posted by one thread per process (:class:`Poster`), in the
order the calls were made: an asynchronous save only hands its entry over
(:func:`post`) and returns, so its round trips never land on the training
thread, which may wait for a core to answer each one when ranks share
cores; a blocking call posts through the same thread and waits for its own
post, so a rank's slots are taken in call order whichever thread calls.

The timeout is, in order: the call's ``collective_timeout`` argument, the
environment variable ``SHARDPOINT_COLLECTIVE_TIMEOUT`` (seconds), or
:data:`DEFAULT_TIMEOUT`. It bounds how long a rank waits for the others to
*enter* the call, i.e. the skew between ranks arriving at a save, so it must
cover the longest legitimate skew: a rank that evaluates, logs or loads data
longer than the others before saving. 600 s covers that with margin, matches
NCCL's default collective timeout, and still reports a real disagreement
three times sooner than gloo's 30-minute default.

Example::

    enter(store, rank=0, world=2, entry=Entry("save", "file:///ckpt/step_100"), timeout=600.0)
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import DistributedError

__all__ = [
    "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "Entry", "Ticket", "Arrival", "collective_timeout", "mismatch_message",
    "timeout_message", "announce", "await_entry", "enter", "Poster", "Posted", "post",
]

DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "SHARDPOINT_COLLECTIVE_TIMEOUT"
_BASE = "shardpoint/enter"


def collective_timeout(value: float | None = None, environ: Any = None) -> float:
    """Seconds to wait for every rank to enter a call: ``value``, else the environment, else the default.

    Example::

        collective_timeout(None, {"SHARDPOINT_COLLECTIVE_TIMEOUT": "30"})  # 30.0
    """
    env = os.environ if environ is None else environ
    source = "collective_timeout"
    if value is None:
        raw = env.get(TIMEOUT_ENV)
        if raw is None or raw == "":
            return DEFAULT_TIMEOUT
        source = TIMEOUT_ENV
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    value = float(value)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {value!r}")
    return value


@dataclass(frozen=True)
class Entry:
    """What a rank is about to do: an operation (``save``, ``load``, ``async_save``) on a path."""

    op: str
    path: str

    def tag(self) -> str:
        """The entry as it travels (one line: the operation, then the path)."""
        return f"{self.op}\n{self.path}"

    @staticmethod
    def parse(tag: str) -> "Entry":
        """The entry a :meth:`tag` describes."""
        op, _, path = tag.partition("\n")
        return Entry(op, path)

    def __str__(self) -> str:
        return f"{self.op} of {self.path}"


def mismatch_message(mine: Entry, rank: int, first: Entry, other_rank: int, other: Entry, first_rank: int = 0) -> str:
    """The error for ranks that entered different calls (pure): rank ``first_rank`` is in ``first``, ``other_rank`` in ``other``."""
    return (
        f"{mine} on rank {rank}: the ranks of the process group are in different calls: rank {first_rank} is in "
        f"{first}, rank {other_rank} is in {other}. Every rank of the group must make the same shardpoint "
        "call (same function, same path) at the same point of the program; a call for one rank alone "
        "takes process_group=sp.LOCAL"
    )


def timeout_message(mine: Entry, rank: int, world: int, arrived: set[int], seconds: float) -> str:
    """The error for a rank that waited ``seconds`` for the others to enter (pure)."""
    missing = sorted(set(range(world)) - arrived - {rank})
    shown = f"{missing[:16]}{' ...' if len(missing) > 16 else ''}"
    return (
        f"{mine} on rank {rank}: waited {seconds:g} s for rank(s) {shown} of {world} to enter the same call; "
        "they are elsewhere (a barrier, another collective, a different code path) or have died. Every rank "
        "of the group must make the same shardpoint call; a call for one rank alone takes "
        f"process_group=sp.LOCAL. Wait longer with collective_timeout= or {TIMEOUT_ENV}"
    )


def _wait(store, keys: list[str], deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return all(store.check([k]) for k in keys)
    try:
        store.wait(keys, datetime.timedelta(seconds=left))
        return True
    except RuntimeError:  # DistStoreError: the wait timed out
        return False


def _arrived(store, slot: str) -> set[int]:
    if not store.check([f"{slot}/in"]):
        return set()
    return {int(r) for r in store.get(f"{slot}/in").decode().split(",") if r}


_KEYS = ("in", "tag0", "first", "n", "bad", "why", "state", "left")


def _cancelled(store, slot: str) -> bool:
    return store.check([f"{slot}/state"]) and store.get(f"{slot}/state") == b"cancel"


def _leave(store, slot: str, world: int) -> None:
    """This rank is done with ``slot``; the last rank to leave deletes its keys."""
    if store.add(f"{slot}/left", 1) == world:
        for name in _KEYS:
            store.delete_key(f"{slot}/{name}")


class Ticket:
    """A rank's entry into a call, posted; :meth:`wait` returns once every rank entered it, or raises.

    This base is an entry that needs no wait (a world of one, or one agreed
    already). Example::

        ticket = announce(store, 0, 2, Entry("async_save", "file:///ck"), 600.0)
        ticket.wait()   # later, before the first exchange with the other ranks
    """

    def wait(self) -> None:
        """Return once every rank entered the same call; raise :class:`DistributedError` otherwise."""


class Arrival(Ticket):
    """One rank's entry posted to slot ``slot`` of the group's store; :meth:`wait` runs :func:`await_entry` once.

    A second ``wait()`` returns, or raises the same error, without asking
    the store again (the rank has left the slot by then).
    """

    def __init__(self, store: Any, rank: int, world: int, entry: Entry, slot: str, deadline: float, timeout: float):
        self.store, self.rank, self.world, self.entry = store, rank, world, entry
        self.slot, self.deadline, self.timeout = slot, deadline, timeout
        self._lock = threading.Lock()
        self._settled: BaseException | None = None
        self._waited = False

    def wait(self) -> None:
        with self._lock:
            if not self._waited:
                try:
                    await_entry(self)
                except Exception as e:  # the store's own failure, too: a later wait must not pass
                    self._settled = e
                finally:
                    self._waited = True
            if self._settled is not None:
                raise self._settled


def announce(store, rank: int, world: int, entry: Entry, timeout: float) -> Arrival:
    """Post this rank's ``entry`` to its next slot, without waiting for the other ranks (see the module docs).

    ``timeout`` counts from now. Example::

        arrival = announce(store, 1, 2, Entry("save", "file:///ck"), 600.0)
    """
    deadline = time.monotonic() + timeout
    while True:
        slot = f"{_BASE}/{store.add(f'{_BASE}/seq/{rank}', 1)}"
        if not _cancelled(store, slot):
            break
        _leave(store, slot, world)  # abandoned before this rank got there: the others moved on
    store.append(f"{slot}/in", f"{rank},")
    if rank == 0:
        store.set(f"{slot}/tag0", entry.tag())  # the reference an error names, whoever arrived first
    mine = f"{rank}\n{entry.tag()}"
    first = store.compare_set(f"{slot}/first", "", mine).decode()
    if first.partition("\n")[2] != entry.tag():
        store.compare_set(f"{slot}/bad", "", mine)  # the first disagreement is the one reported
    if store.add(f"{slot}/n", 1) == world:
        store.compare_set(f"{slot}/state", "", "go")
    return Arrival(store, rank, world, entry, slot, deadline, timeout)


def await_entry(arrival: Arrival) -> None:
    """Wait until every rank posted the same entry to ``arrival``'s slot; raise :class:`DistributedError` otherwise."""
    store, slot, rank, entry = arrival.store, arrival.slot, arrival.rank, arrival.entry
    try:
        if not _wait(store, [f"{slot}/state"], arrival.deadline):
            why = timeout_message(entry, rank, arrival.world, _arrived(store, slot), arrival.timeout)
            store.compare_set(f"{slot}/why", "", why)
            store.compare_set(f"{slot}/state", "", "cancel")
        if store.get(f"{slot}/state") != b"go":
            raise DistributedError(store.get(f"{slot}/why").decode(), {rank: "entry timed out"})
        if store.check([f"{slot}/bad"]):
            raise _disagreement(store, slot, entry, rank)
    finally:
        _leave(store, slot, arrival.world)


def _disagreement(store, slot: str, entry: Entry, rank: int) -> DistributedError:
    """The error of a slot whose ranks disagreed: rank 0's call beside one that differs from it."""
    tag0 = store.get(f"{slot}/tag0").decode()
    pairs = [store.get(f"{slot}/{k}").decode().partition("\n") for k in ("first", "bad")]
    other_rank, _, other = next(p for p in pairs if p[2] != tag0)  # the two differ: one differs from rank 0
    return DistributedError(
        mismatch_message(entry, rank, Entry.parse(tag0), int(other_rank), Entry.parse(other)),
        {int(other_rank): str(Entry.parse(other))},
    )


def enter(store, rank: int, world: int, entry: Entry, timeout: float) -> None:
    """Wait until every rank of the group has entered ``entry``; raise :class:`DistributedError` otherwise.

    ``store`` is the group's key-value store (keys are scoped to the group).
    :func:`announce` (through the process's :class:`Poster`), then :func:`await_entry`.
    """
    await_entry(_POSTER.now(store, rank, world, entry, timeout))


class Posted(Ticket):
    """An entry handed to the process's :class:`Poster`; :meth:`wait` waits for its post, then for the other ranks.

    A post that failed (the store's error) raises at every ``wait()``.
    """

    def __init__(self, future: "cf.Future[Arrival]"):
        self._future = future

    def wait(self) -> None:
        self._future.result().wait()


class Poster:
    """One thread that posts this process's entries (:func:`announce`) in the order they were handed over.

    :meth:`later` returns at once (the caller waits for the other ranks
    through the :class:`Posted` ticket); :meth:`now` posts after everything
    handed over before it, and returns the arrival. The thread starts with
    the first post and again after a fork.

    Example::

        ticket = Poster().later(store, 0, 2, Entry("async_save", "file:///ck"), 600.0)
        ticket.wait()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, "shardpoint-enter")
            return self._pool

    def later(self, store, rank: int, world: int, entry: Entry, timeout: float) -> Posted:
        """Hand ``entry`` over to be posted after every earlier one; never waits."""
        return Posted(self._executor().submit(announce, store, rank, world, entry, timeout))

    def now(self, store, rank: int, world: int, entry: Entry, timeout: float) -> Arrival:
        """Post ``entry`` after every earlier one, and return its arrival."""
        return self._executor().submit(announce, store, rank, world, entry, timeout).result()

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there; the next post starts a new one."""
        self._lock = threading.Lock()
        self._pool = None


# One per process by necessity: a rank's slots must be taken in call order, whichever thread calls.
_POSTER = Poster()
os.register_at_fork(after_in_child=_POSTER.forget)


def post(store, rank: int, world: int, entry: Entry, timeout: float, wait: bool = True) -> Ticket:
    """Post this rank's ``entry`` in call order: now (``wait=True``: the arrival), or on the poster thread (a :class:`Posted`).

    Example::

        ticket = post(store, 0, 2, Entry("async_save", "file:///ck"), 600.0, wait=False); ...; ticket.wait()
    """
    if wait:
        return _POSTER.now(store, rank, world, entry, timeout)
    return _POSTER.later(store, rank, world, entry, timeout)
