"""Concurrent writers of one checkpoint path never destroy committed data.

Unit checks of the claim and the cleanup on every storage kind, then real
processes racing a small and a large save to one path, round after round:
afterwards the path loads exactly one of the two states, bit for bit, and
every save that reported success is the one the path holds (or was
overwritten by a save that started after it returned).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import shardpoint as sp
from shardpoint.engine.claim import CLAIM_NAME, CommitPolicy, SaveClaim, claim_stale_reason, host_id
from shardpoint.format.manifest import MANIFEST_NAME
from shardpoint.storage import FsspecStorage, LocalStorage, MemoryStorage, S3Storage
from shardpoint.storage.base import remove_unreferenced
from tests.storage.concurrent_worker import make_state
from tests.storage.s3_helpers import s3_options

KINDS = ["memory", "local", "fsspec-memory", "fsspec-local", "s3"]


@pytest.fixture(params=KINDS)
def make(request, tmp_path, s3_endpoint, bucket):
    kind = request.param
    if kind == "memory":
        mem = MemoryStorage()
        return lambda: mem.child(uuid.uuid4().hex)
    if kind == "local":
        return lambda: LocalStorage(str(tmp_path / uuid.uuid4().hex))
    if kind == "fsspec-memory":
        fs = fsspec.filesystem("memory")
        return lambda: FsspecStorage(fs, f"/{uuid.uuid4().hex}")
    if kind == "fsspec-local":
        return lambda: FsspecStorage(LocalFileSystem(), str(tmp_path / uuid.uuid4().hex))
    return lambda: S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(s3_endpoint))


def _claim_body(**over) -> bytes:
    now = time.time()
    body = {"token": uuid.uuid4().hex, "host": "elsewhere/boot", "pid": 1, "pid_start": 1.0, "created": now, "expires": now + 600}
    body.update(over)
    return json.dumps(body).encode()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_one_claim_at_a_time(make):
    st = make()
    a = SaveClaim.acquire(st, CommitPolicy(), st.url)
    with pytest.raises(sp.ConcurrentSaveError, match=r"another save is writing this checkpoint \(process \d+ on") as ei:
        SaveClaim.acquire(st, CommitPolicy(), st.url)
    assert ei.value.path == st.url and str(os.getpid()) in ei.value.holder
    # A save to the claimed path fails typed, and commits nothing.
    with pytest.raises(sp.ConcurrentSaveError):
        sp.save(st, {"w": torch.ones(4)})
    assert not st.exists(MANIFEST_NAME)
    assert sorted(st.list()) == [CLAIM_NAME]  # the failed save removed its own files
    a.confirm()
    a.release()
    assert not st.exists(CLAIM_NAME)
    sp.save(st, {"w": torch.ones(4)})
    assert st.list() == sorted([*sp.read_manifest(st).files, MANIFEST_NAME])


def test_stale_claims_are_taken_over(make):
    st = make()
    # Same host, its process gone: taken over at once.
    st.put_atomic(CLAIM_NAME, _claim_body(host=host_id(), pid=_dead_pid(), pid_start=None))
    sp.save(st, {"w": torch.full((3,), 2.0)})
    assert torch.equal(sp.read_tensor(st, "w"), torch.full((3,), 2.0)) and not st.exists(CLAIM_NAME)
    # Another host inside its lease: live. After the lease: taken over.
    st.put_atomic(CLAIM_NAME, _claim_body())
    with pytest.raises(sp.ConcurrentSaveError, match="'elsewhere'"):
        sp.save(st, {"w": torch.zeros(3)})
    assert torch.equal(sp.read_tensor(st, "w"), torch.full((3,), 2.0))
    st.put_atomic(CLAIM_NAME, _claim_body(expires=time.time() - 1))
    sp.save(st, {"w": torch.zeros(3)})
    assert torch.equal(sp.read_tensor(st, "w"), torch.zeros(3))
    # A garbage claim (a torn write by some other tool) is stale too.
    st.put_atomic(CLAIM_NAME, b"\x00garbage")
    sp.save(st, {"w": torch.ones(3)})
    assert torch.equal(sp.read_tensor(st, "w"), torch.ones(3))


def test_a_claim_taken_over_stops_its_old_owner(make):
    st = make()
    old = SaveClaim.acquire(st, CommitPolicy(lease_s=5), st.url)
    raw = st.get(CLAIM_NAME)
    new = SaveClaim(st, CommitPolicy(), st.url)
    assert st.replace_if(CLAIM_NAME, raw, new.body)
    assert not st.replace_if(CLAIM_NAME, raw, b"late")  # the same stale claim is replaced once
    with pytest.raises(sp.ConcurrentSaveError, match="taken over by another save"):
        old.confirm()
    old.release()  # not its claim any more: left alone
    assert st.get(CLAIM_NAME) == new.body
    new.confirm()
    new.release()
    assert not st.exists(CLAIM_NAME)


def test_stale_reasons():
    now = time.time()
    assert claim_stale_reason(json.loads(_claim_body()), now) is None
    assert "lease ran out" in claim_stale_reason(json.loads(_claim_body(expires=now - 5)), now)
    me = json.loads(_claim_body(host=host_id(), pid=os.getpid(), pid_start=None))
    assert claim_stale_reason(me, now) is None
    assert "now belongs to another process" in claim_stale_reason({**me, "pid_start": -1.0}, now)
    assert "unreadable" in claim_stale_reason({}, now)
    with pytest.raises(ValueError):
        CommitPolicy(lease_s=0)
    with pytest.raises(ValueError):
        CommitPolicy(cleanup_grace_s=-1)


def test_cleanup_keeps_committed_and_young_files(make):
    st = make()
    sp.save(st, {"w": torch.ones(8)})
    committed = set(sp.read_manifest(st).files)
    with st.open_writer("data/orphan.bin") as w:
        w.write(b"x" * 10)
    times = st.modified_times("data/")
    assert set(times) == committed | {"data/orphan.bin"}
    assert all(t is not None and abs(t - time.time()) < 120 for t in times.values()), times
    later = time.time() + 1000
    # Young files survive any cleanup; old unreferenced ones go; files the committed manifest
    # lists stay even when the caller's own manifest ("keep") does not list them.
    assert remove_unreferenced(st, set(), lambda: committed, grace_s=2000, now=later) == []
    assert remove_unreferenced(st, set(), lambda: committed, grace_s=10, now=later) == ["data/orphan.bin"]
    assert remove_unreferenced(st, set(), lambda: None, grace_s=0, now=later) == []  # unreadable manifest
    assert set(st.list("data/")) == committed
    assert torch.equal(sp.read_tensor(st, "w"), torch.ones(8))


def test_late_save_keeps_the_newer_commit(make):
    """A save whose cleanup runs after another save committed must not delete that save's files."""
    st = make()
    first = sp.save(st, {"w": torch.ones(4)}, commit=CommitPolicy(cleanup_grace_s=0))
    mine = set(sp.read_manifest(st).files)
    second = sp.save(st, {"w": torch.zeros(4)}, commit=CommitPolicy(cleanup_grace_s=3600))
    assert second.save_id != first.save_id
    theirs = set(sp.read_manifest(st).files)
    # The first save's cleanup, run now, knows only its own manifest: it re-reads the committed one.
    from shardpoint.engine.claim import cleanup_after_commit

    written = b"{}"  # not what is committed now
    cleanup_after_commit(st, mine, written, 0.0, st.url)
    assert theirs <= set(st.list("data/"))
    assert torch.equal(sp.read_tensor(st, "w"), torch.zeros(4))


def test_converter_claims_its_output(tmp_path):
    from shardpoint.convert.common import CheckpointWriter

    out = str(tmp_path / "conv")
    with CheckpointWriter(out) as w:
        with pytest.raises(sp.ConcurrentSaveError):
            sp.save(out, {"w": torch.ones(2)})
        w.add("w", torch.arange(4.0))
        w.commit()
    assert not os.path.exists(os.path.join(out, CLAIM_NAME))
    assert torch.equal(sp.read_tensor(out, "w"), torch.arange(4.0))


def test_async_save_to_a_claimed_path_fails_in_wait(tmp_path):
    path = str(tmp_path / "a")
    st = LocalStorage(path)
    held = SaveClaim.acquire(st, CommitPolicy(), st.url)
    saver = sp.AsyncSaver(staging_bytes=1 << 16, piece_bytes=1 << 12)
    h = saver.save(path, {"w": torch.randn(1 << 16)})  # larger than the staging ring: the copy must not block
    with pytest.raises(sp.ConcurrentSaveError):
        h.wait(timeout=60)
    held.release()
    saver.save(path, {"w": torch.ones(3)}).wait(timeout=60)
    assert torch.equal(sp.read_tensor(path, "w"), torch.ones(3))


# ------------------------------------------------------------------ real processes
class _Worker:
    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage.concurrent_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"worker died (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers():
    ws = [_Worker(), _Worker()]
    yield ws
    for w in ws:
        w.close()


def _target(kind: str, tmp_path, bucket) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex}/ck" if kind == "s3" else str(tmp_path / kind / "ck")


def _reader(kind: str, path: str, endpoint: str):
    from tests.storage.concurrent_worker import storage_of

    return storage_of(kind, path, endpoint)


ROUNDS = 5


def test_racing_processes_leave_exactly_one_whole_checkpoint(workers, tmp_path, s3_endpoint, bucket):
    expected = {w: make_state(w) for w in ("small", "large")}
    tally = {"one_failed": 0, "both_ok": 0}
    for kind in ("local", "fsspec", "s3"):
        path = _target(kind, tmp_path, bucket)
        for rnd in range(ROUNDS):
            which = ("small", "large") if rnd % 2 == 0 else ("large", "small")
            start = time.time() + 0.4
            for w, wh in zip(workers, which):
                w.send({"op": "save", "kind": kind, "path": path, "which": wh, "start_at": start, "endpoint": s3_endpoint})
            answers = [w.answer() for w in workers]
            oks = [(a, wh) for a, wh in zip(answers, which) if a["ok"]]
            for a in answers:
                if not a["ok"]:
                    assert a["error"] == "ConcurrentSaveError", a
            assert oks, f"{kind} round {rnd}: no save succeeded: {answers}"
            st = _reader(kind, path, s3_endpoint)
            state = {"w": torch.empty(0), "b": torch.empty(0), "extra": {}}
            sp.load(st, state)
            got = state["extra"]["which"]
            want = expected[got]
            assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]), (kind, rnd)
            # Truthful reports: the path holds the save that succeeded last.
            last = max(oks, key=lambda x: x[0]["t_end"])
            assert (got, sp.read_manifest(st, chunks=False).save_id) == (last[1], last[0]["save_id"]), (kind, rnd, answers)
            assert not st.exists(CLAIM_NAME)
            tally["both_ok" if len(oks) == 2 else "one_failed"] += 1
    print("concurrent rounds:", tally)


def test_crashed_writer_claim_is_taken_over(tmp_path, s3_endpoint, bucket):
    targets = [[kind, _target(kind, tmp_path, bucket)] for kind in ("local", "fsspec", "s3")]
    w = _Worker()
    try:
        w.send({"op": "claim", "targets": targets, "endpoint": s3_endpoint})
        assert w.answer() == {"ok": True}
        for kind, path in targets:
            with pytest.raises(sp.ConcurrentSaveError, match=f"process {w.proc.pid} on"):
                sp.save(_reader(kind, path, s3_endpoint), {"w": torch.ones(2)})
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        for kind, path in targets:
            st = _reader(kind, path, s3_endpoint)
            assert st.exists(CLAIM_NAME)  # left behind by the crash
            sp.save(st, {"w": torch.full((2,), 7.0)})
            assert torch.equal(sp.read_tensor(st, "w"), torch.full((2,), 7.0)), kind
            assert not st.exists(CLAIM_NAME)
    finally:
        w.close()


def test_hostname_is_part_of_the_host_id():
    assert host_id().split("/")[0] == socket.gethostname()
