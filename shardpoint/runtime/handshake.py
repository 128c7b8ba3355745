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

Protocol, per group, with a counter per rank in the store (no process-wide
state): a rank takes its next *slot* ``k``, skipping slots that an earlier
timeout abandoned before this rank got there. Rank 0 posts its entry; the
others compare theirs with it and post any disagreement. The last rank to
arrive marks the slot ``go``; a rank whose wait times out marks it
``cancel`` instead. The store's compare-and-set makes exactly one of the two
win, so either every rank proceeds or none does. Rank 0 deletes the keys of
the previous slot once a slot goes (every rank has then left it). Cost of a
normal call: about ten store round trips per rank (well under a
millisecond on one host).

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

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

from ..errors import DistributedError

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "Entry", "collective_timeout", "mismatch_message", "timeout_message", "enter"]

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


def mismatch_message(mine: Entry, rank: int, first: Entry, other_rank: int, other: Entry) -> str:
    """The error for ranks that entered different calls (pure)."""
    return (
        f"{mine} on rank {rank}: the ranks of the process group are in different calls: rank 0 is in "
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


def enter(store, rank: int, world: int, entry: Entry, timeout: float) -> None:
    """Wait until every rank of the group has entered ``entry``; raise :class:`DistributedError` otherwise.

    ``store`` is the group's key-value store (keys are scoped to the group).
    """
    deadline = time.monotonic() + timeout
    while True:
        k = store.add(f"{_BASE}/seq/{rank}", 1)
        slot = f"{_BASE}/{k}"
        if not store.check([f"{slot}/state"]) or store.get(f"{slot}/state") != b"cancel":
            break  # a slot abandoned before this rank arrived is skipped: the others moved on
    store.append(f"{slot}/in", f"{rank},")
    tag = entry.tag()
    ok = True
    if rank == 0:
        store.set(f"{slot}/tag0", tag)
    elif _wait(store, [f"{slot}/tag0"], deadline):
        if store.get(f"{slot}/tag0").decode() != tag:
            store.set(f"{slot}/bad", f"{rank}\n{tag}")
    else:
        ok = False
    if ok and store.add(f"{slot}/n", 1) == world:
        store.compare_set(f"{slot}/state", "", "go")
    if ok:
        ok = _wait(store, [f"{slot}/state"], deadline)
    if not ok:
        why = timeout_message(entry, rank, world, _arrived(store, slot), timeout)
        store.compare_set(f"{slot}/why", "", why)
        store.compare_set(f"{slot}/state", "", "cancel")
    state = store.get(f"{slot}/state")
    if state != b"go":
        raise DistributedError(store.get(f"{slot}/why").decode() if ok else why, {rank: "entry timed out"})
    if store.check([f"{slot}/bad"]):
        bad_rank, _, bad_tag = store.get(f"{slot}/bad").decode().partition("\n")
        first = Entry.parse(store.get(f"{slot}/tag0").decode())
        raise DistributedError(
            mismatch_message(entry, rank, first, int(bad_rank), Entry.parse(bad_tag)), {int(bad_rank): str(Entry.parse(bad_tag))}
        )
    if rank == 0 and k > 1:
        prev = f"{_BASE}/{k - 1}"
        if store.compare_set(f"{prev}/state", "go", "done") == b"done":
            for name in ("in", "tag0", "n", "bad", "why", "state"):
                store.delete_key(f"{prev}/{name}")
