"""The entry handshake on a real TCPStore, ranks as threads (no process group), and its pure parts."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

import shardpoint as sp
from shardpoint.dist import LOCAL, Comm
from shardpoint.errors import DistributedError
from shardpoint.runtime.handshake import (
    DEFAULT_TIMEOUT, TIMEOUT_ENV, Entry, announce, collective_timeout, enter, mismatch_message, post, timeout_message,
)


@pytest.fixture
def stores():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)

    def client():
        return dist.PrefixStore("group0/", dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10)))

    yield client
    del server


def _run(calls):
    """Run ``calls`` (one callable per rank) on threads; return each one's result or exception."""
    out: list = [None] * len(calls)

    def go(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=go, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_agreeing_ranks_pass_and_old_slots_are_deleted(stores):
    s = [stores() for _ in range(3)]
    e = Entry("save", "file:///ck")
    for _ in range(3):
        assert _run([lambda r=r: enter(s[r], r, 3, e, 5.0) for r in range(3)]) == [None, None, None]
    for k in (1, 2, 3):  # the last rank to leave a slot deletes its keys
        assert not any(s[0].check([f"shardpoint/enter/{k}/{name}"]) for name in ("state", "first", "in", "n", "left"))


def test_a_posted_entry_waits_in_the_background_while_its_rank_enters_the_next_call(stores):
    s = [stores() for _ in range(2)]
    a, b = Entry("async_save", "file:///a"), Entry("load", "file:///b")
    posted = [announce(s[r], r, 2, a, 5.0) for r in range(2)]  # on the training threads: nothing waits
    # Both ranks move on to a load and agree on it, while the save's entry is not awaited yet.
    assert _run([lambda r=r: enter(s[r], r, 2, b, 5.0) for r in range(2)]) == [None, None]
    assert s[0].get(f"{posted[0].slot}/state") == b"go"  # still there: no rank has left it
    assert _run([p.wait for p in posted]) == [None, None]
    assert not s[0].check([f"{posted[0].slot}/state"])


def test_a_disagreement_posted_without_waiting_is_raised_by_the_wait(stores):
    s = [stores() for _ in range(2)]
    posted = [announce(s[0], 0, 2, Entry("async_save", "file:///a"), 5.0), announce(s[1], 1, 2, Entry("save", "file:///a"), 5.0)]
    res = _run([p.wait for p in posted])
    for e in res:
        assert isinstance(e, DistributedError)
        assert "rank 0 is in async_save of file:///a, rank 1 is in save of file:///a" in str(e)


def test_disagreeing_ranks_all_raise_naming_both_calls(stores):
    s = [stores() for _ in range(3)]
    a, b = Entry("save", "file:///a"), Entry("load", "file:///b")
    t0 = time.monotonic()
    res = _run([lambda: enter(s[0], 0, 3, a, 20.0), lambda: enter(s[1], 1, 3, b, 20.0), lambda: enter(s[2], 2, 3, a, 20.0)])
    assert time.monotonic() - t0 < 5  # no timeout involved: a disagreement is seen at once
    for r, e in enumerate(res):
        assert isinstance(e, DistributedError), (r, e)
        assert "rank 0 is in save of file:///a, rank 1 is in load of file:///b" in str(e)
        assert e.causes == {1: "load of file:///b"}
    # The group is in step again: the next agreeing call passes.
    assert _run([lambda r=r: enter(s[r], r, 3, a, 5.0) for r in range(3)]) == [None, None, None]


def test_a_rank_elsewhere_times_out_and_the_group_recovers(stores):
    s = [stores() for _ in range(2)]
    e = Entry("save", "file:///ck")
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"save of file:///ck on rank 0: waited 0.3 s for rank\(s\) \[1\] of 2") as err:
        enter(s[0], 0, 2, e, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert "SHARDPOINT_COLLECTIVE_TIMEOUT" in str(err.value) and "sp.LOCAL" in str(err.value)
    # Rank 1 was in a barrier; afterwards both call the same save: rank 1 skips the abandoned slot.
    assert _run([lambda r=r: enter(s[r], r, 2, e, 5.0) for r in range(2)]) == [None, None]
    # Rank 0 missing this time: rank 1 times out waiting for rank 0's entry.
    with pytest.raises(DistributedError, match=r"on rank 1: waited 0.2 s for rank\(s\) \[0\]"):
        enter(s[1], 1, 2, e, 0.2)
    assert _run([lambda r=r: enter(s[r], r, 2, e, 5.0) for r in range(2)]) == [None, None]


def test_pure_parts():
    assert collective_timeout(None, {}) == DEFAULT_TIMEOUT == 600.0
    assert collective_timeout(None, {TIMEOUT_ENV: "2.5"}) == 2.5
    assert collective_timeout(7, {TIMEOUT_ENV: "2.5"}) == 7.0
    for bad in ("abc",):
        with pytest.raises(ValueError, match=TIMEOUT_ENV):
            collective_timeout(None, {TIMEOUT_ENV: bad})
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            collective_timeout(bad, {})
    assert Entry.parse(Entry("load", "s3://b/k").tag()) == Entry("load", "s3://b/k")
    msg = timeout_message(Entry("save", "p"), 0, 40, {0, 1, 2}, 1.0)
    assert "rank(s) [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] ... of 40" in msg
    assert "rank 0 is in save of a, rank 2 is in load of a" in mismatch_message(Entry("save", "a"), 1, Entry("save", "a"), 2, Entry("load", "a"))


def test_local_is_a_world_of_one_without_a_process_group():
    assert repr(sp.LOCAL) == "shardpoint.LOCAL" and sp.LOCAL is LOCAL
    c = Comm.resolve(sp.LOCAL)
    assert (c.rank, c.world, c.active, c.local) == (0, 1, False, True)
    c.enter("save", "x", 0.001)  # free: nothing to wait for


def test_without_a_store_a_disagreement_is_still_named(monkeypatch):
    import shardpoint.dist as sd

    monkeypatch.setattr(sd, "_group_store", lambda group: None)
    c = Comm.__new__(Comm)
    c.group, c.active, c.rank, c.world = None, True, 1, 2
    monkeypatch.setattr(c, "all_gather", lambda tag: [Entry("save", "a").tag(), tag])
    c.enter("save", "a")  # agreement
    with pytest.raises(DistributedError, match="rank 0 is in save of a, rank 1 is in load of a"):
        c.enter("load", "a")


class _GatedStore:
    """A store whose ``add`` waits for ``gate`` and records the threads that used it."""

    def __init__(self, store, gate: threading.Event):
        self.store, self.gate, self.threads = store, gate, set()

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args, **kwargs):
            self.threads.add(threading.current_thread().name)
            if name == "add":
                self.gate.wait(10)
            return fn(*args, **kwargs)
        return call


def test_a_later_post_returns_before_any_store_round_trip_and_waits_behind_nothing_on_the_caller(stores):
    gate = threading.Event()
    s0, s1 = _GatedStore(stores(), gate), stores()
    e = Entry("async_save", "file:///a")
    t0 = time.monotonic()
    ticket = post(s0, 0, 2, e, 5.0, wait=False)  # the store answers nothing until the gate opens
    assert time.monotonic() - t0 < 0.5
    assert threading.current_thread().name not in s0.threads
    gate.set()
    assert _run([ticket.wait, lambda: enter(s1, 1, 2, e, 5.0)]) == [None, None]
    # The post ran on the poster thread; the wait's half ran on the waiting thread; the caller's thread on neither.
    assert "shardpoint-enter_0" in s0.threads and threading.current_thread().name not in s0.threads


def test_posts_follow_call_order_whichever_thread_calls(stores):
    # Rank 0 hands an async save's entry over, then enters a blocking load at once; its post is slow. Rank 1 makes
    # the same two calls in the same order. Posted out of order, rank 0's first slot would hold the load: a mismatch.
    gate = threading.Event()
    s0, s1 = _GatedStore(stores(), gate), stores()
    a, b = Entry("async_save", "file:///a"), Entry("load", "file:///b")
    threading.Timer(0.3, gate.set).start()

    def rank0():
        ticket = post(s0, 0, 2, a, 5.0, wait=False)
        enter(s0, 0, 2, b, 5.0)
        ticket.wait()

    def rank1():
        enter(s1, 1, 2, a, 5.0)
        enter(s1, 1, 2, b, 5.0)

    assert _run([rank0, rank1]) == [None, None]


def test_a_failed_post_fails_every_wait_of_its_ticket(stores):
    class Broken:
        def add(self, *args):
            raise RuntimeError("store unreachable")

    ticket = post(Broken(), 0, 2, Entry("async_save", "file:///a"), 5.0, wait=False)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="store unreachable"):
            ticket.wait()
