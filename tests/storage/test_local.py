"""The local backend's write paths: positional buffered writes and optional O_DIRECT.

The O_DIRECT variant runs the whole conformance suite, and the tests here
check what the suite cannot see: every O_DIRECT write is aligned in memory,
offset and length, the unaligned tail goes through the page cache, a
filesystem that refuses O_DIRECT gets buffered writes with the reason, and an
O_DIRECT save is still atomic (data durable first, manifest last).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.errors import IncompleteCheckpointError, StorageError
from shardpoint.storage import LocalOptions, LocalStorage, storage_for
from shardpoint.storage.local import aligned_buffer

from .test_conformance import StorageConformance, write_file

O_DIRECT = getattr(os, "O_DIRECT", 0)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUF = 16384  # small staging buffers, so that short payloads cross buffer boundaries


def direct_refused(folder) -> str | None:
    """Why the filesystem under ``folder`` refuses O_DIRECT writes (``None`` if it accepts them)."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = os.path.join(str(folder), ".odirect-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    except OSError as e:
        return f"open with O_DIRECT failed: {e}"
    try:
        os.pwrite(fd, aligned_buffer(4096, 4096), 0)
    except OSError as e:
        return f"an aligned O_DIRECT write failed: {e}"
    finally:
        os.close(fd)
        os.unlink(path)
    return None


@pytest.fixture
def direct_ok(tmp_path):
    reason = direct_refused(tmp_path)
    if reason is not None:
        pytest.skip(f"the filesystem under test refuses O_DIRECT: {reason}")


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


@pytest.fixture
def pwrites(monkeypatch):
    """Record every os.pwrite as (O_DIRECT?, offset, length, buffer address)."""
    log: list[tuple[bool, int, int, int]] = []
    real = os.pwrite

    def spy(fd, data, offset):
        mv = memoryview(data).cast("B")
        addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if len(mv) else 0
        log.append((is_direct(fd), offset, len(mv), addr))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    return log


class TestLocalStorageDirect(StorageConformance):
    """The conformance suite with O_DIRECT data files (small buffers, one and two of them)."""

    @pytest.fixture(params=[1, 2], ids=["1buf", "2buf"])
    def make_storage(self, request, tmp_path, direct_ok):
        counter = iter(range(1_000_000))
        made: list[LocalStorage] = []

        def make():
            st = LocalStorage(str(tmp_path / f"d{next(counter)}" / "ckpt"), direct=True,
                              direct_buffer_size=BUF, direct_buffers=request.param)
            made.append(st)
            return st

        yield make
        for st in made:  # the suite really ran on O_DIRECT, not on a silent fallback
            assert st.direct_fallback_reason is None, st.direct_fallback_reason


# --- aligned body, unaligned tail ----------------------------------------------------------------

SIZES = [0, 1, 511, 4095, 4096, 4097, BUF - 1, BUF, BUF + 1, 3 * BUF + 4096, 5 * BUF + 17]


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("piece", [None, 777, BUF])
def test_direct_tail_bit_exact(tmp_path, direct_ok, pwrites, buffers, size, piece):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_buffer_size=BUF, direct_buffers=buffers)
    step = piece or max(size, 1)
    with st.open_writer("data/x.bin") as w:
        for i in range(0, size, step):
            w.write(memoryview(payload)[i : i + step])
    with open(os.path.join(st.root, "data", "x.bin"), "rb") as f:
        assert f.read() == payload  # bit-exact, and not one byte longer
    assert st.read("data/x.bin", 0, size) == payload
    assert st.direct_fallback_reason is None
    direct = [(off, n, addr) for d, off, n, addr in pwrites if d]
    buffered = [(off, n) for d, off, n, _ in pwrites if not d]
    for off, n, addr in direct:
        assert off % 4096 == 0 and n % 4096 == 0 and addr % 4096 == 0, (off, n, addr)
    tail = size % 4096
    assert sum(n for _, n, _ in direct) == size - tail
    assert buffered == ([(size - tail, tail)] if tail else [])


def test_direct_buffer_alignment_option(tmp_path, direct_ok, pwrites):
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_alignment=8192, direct_buffer_size=2 * 8192)
    payload = os.urandom(5 * 8192 + 100)
    write_file(st, "a.bin", payload)
    assert st.read("a.bin", 0, len(payload)) == payload
    direct = [(off, n, addr) for d, off, n, addr in pwrites if d]
    assert direct and all(off % 8192 == 0 and n % 8192 == 0 and addr % 8192 == 0 for off, n, addr in direct)
    assert [(off, n) for d, off, n, _ in pwrites if not d] == [(5 * 8192, 100)]


@pytest.mark.parametrize("alignment", [512, 4096, 65536])
def test_aligned_buffer(alignment):
    for size in (alignment, 3 * alignment):
        b = aligned_buffer(size, alignment)
        assert len(b) == size and not b.readonly
        assert np.frombuffer(b, dtype=np.uint8).ctypes.data % alignment == 0


# --- fallback where the filesystem refuses O_DIRECT --------------------------------------------


def test_open_refused_falls_back_with_reason(tmp_path, monkeypatch, caplog, pwrites):
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_buffer_size=BUF)
    payloads = [os.urandom(3 * BUF + 5), os.urandom(100)]
    with caplog.at_level(logging.WARNING, logger="shardpoint.storage.local"):
        write_file(st, "data/a.bin", payloads[0])
        write_file(st.child("sub"), "b.bin", payloads[1])  # children share the verdict
    assert st.read("data/a.bin", 0, len(payloads[0])) == payloads[0]
    assert st.read("sub/b.bin", 0, 100) == payloads[1]
    reason = st.direct_fallback_reason
    assert reason is not None and reason.startswith("open with O_DIRECT failed: [Errno 22] Invalid argument")
    assert st.child("sub").direct_fallback_reason == reason
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "O_DIRECT refused (open with O_DIRECT failed" in warnings[0]
    assert "writing data files buffered instead" in warnings[0]
    assert not any(d for d, *_ in pwrites)


@pytest.mark.parametrize("buffers", [1, 2])
def test_first_direct_write_refused_falls_back(tmp_path, direct_ok, monkeypatch, caplog, buffers):
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_buffer_size=BUF, direct_buffers=buffers)
    payload = os.urandom(4 * BUF + 1234)
    with caplog.at_level(logging.WARNING, logger="shardpoint.storage.local"):
        write_file(st, "a.bin", *[memoryview(payload)[i : i + 1000] for i in range(0, len(payload), 1000)])
    assert refused == [0]  # asked once, then buffered for the rest of the file
    assert st.read("a.bin", 0, len(payload)) == payload and st.size("a.bin") == len(payload)
    assert st.direct_fallback_reason.startswith("the first O_DIRECT write failed: [Errno 22]")
    assert "O_DIRECT refused" in caplog.text


def _fail_direct_writes(monkeypatch, err: int, message: str):
    """Make O_DIRECT writes from the third buffer on fail with ``err``; returns the real pwrite."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if is_direct(fd) and offset >= 2 * BUF:
            raise OSError(err, message)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return real


@pytest.mark.parametrize("buffers", [1, 2])
def test_later_direct_write_error_is_raised_not_hidden(tmp_path, direct_ok, monkeypatch, buffers):
    """EINVAL after O_DIRECT writes succeeded is a real failure: the writer raises and removes the file."""
    _fail_direct_writes(monkeypatch, errno.EIO, "Input/output error (injected)")
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_buffer_size=BUF, direct_buffers=buffers)
    with pytest.raises(OSError, match=r"Input/output error \(injected\)") as ei:
        with st.open_writer("data/a.bin") as w:
            for _ in range(8):
                w.write(os.urandom(BUF))
    assert ei.value.errno == errno.EIO
    assert not st.exists("data/a.bin") and st.direct_fallback_reason is None


def test_no_o_direct_on_platform(tmp_path, monkeypatch, caplog):
    import shardpoint.storage.local as local

    monkeypatch.setattr(local, "_O_DIRECT", 0)
    st = LocalStorage(str(tmp_path / "c"), direct=True)
    with caplog.at_level(logging.WARNING, logger="shardpoint.storage.local"):
        write_file(st, "a.bin", b"abc")
    assert st.read("a.bin", 0, 3) == b"abc"
    assert st.direct_fallback_reason == "this platform has no O_DIRECT"


# --- positional writes, options ------------------------------------------------------------------


def test_buffered_writes_ignore_the_file_position(tmp_path):
    """Writes name their offset: moving the descriptor's position changes nothing."""
    st = LocalStorage(str(tmp_path / "c"))
    w = st.open_writer("a.bin")
    w.write(b"0123456789")
    os.lseek(w._fd, 3, os.SEEK_SET)
    w.write(b"abc")
    w.close()
    assert st.read("a.bin", 0, 13) == b"0123456789abc"


def test_options_and_resolution(tmp_path):
    st = storage_for(str(tmp_path / "a"), direct=True, direct_buffers=1)
    assert isinstance(st, LocalStorage)
    assert st.options == LocalOptions(direct=True, direct_buffers=1)
    st2 = storage_for(f"file://{tmp_path}/b", options=LocalOptions(direct=True))
    assert st2.options.direct and st2.root == str(tmp_path / "b")
    assert LocalStorage(str(tmp_path)).options == LocalOptions() and not LocalOptions().direct
    child = st.child("x")
    assert child.options is st.options and child.root == str(tmp_path / "a" / "x")
    again = pickle.loads(pickle.dumps(child))
    assert again.options == st.options and again.root == child.root
    with pytest.raises(TypeError, match="unknown local storage option.*see shardpoint.storage.LocalOptions"):
        storage_for(str(tmp_path / "a"), o_direct=True)
    with pytest.raises(ValueError, match="direct_alignment must be a power of two >= 512, got 1000"):
        LocalOptions(direct_alignment=1000)
    with pytest.raises(ValueError, match=r"direct_buffer_size must be a positive multiple of direct_alignment \(4096\), got 5000"):
        LocalOptions(direct_buffer_size=5000)
    with pytest.raises(ValueError, match="direct_buffers must be at least 1, got 0"):
        LocalOptions(direct_buffers=0)


def test_write_after_close_is_refused(tmp_path, direct_ok):
    st = LocalStorage(str(tmp_path / "c"), direct=True, direct_buffer_size=BUF)
    w = st.open_writer("a.bin")
    w.write(b"x")
    w.close()
    with pytest.raises(StorageError, match="write to .*a.bin after close or abort"):
        w.write(b"y")


def test_new_folders_are_fsynced_in_their_parents(tmp_path, monkeypatch):
    """A durable file in a new folder needs the folder's entry in its parent durable too."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    st = LocalStorage(str(tmp_path / "run" / "step_1"))
    write_file(st, "data/a.bin", b"abc")
    for d in (tmp_path, tmp_path / "run", tmp_path / "run" / "step_1", tmp_path / "run" / "step_1" / "data"):
        assert str(d) in synced, (d, synced)


# --- an O_DIRECT save is still atomic -------------------------------------------------------------


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g),
            "h": torch.randn(5000, generator=g).to(torch.bfloat16), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _fresh() -> dict:
    return {"w": torch.zeros(300, 70), "b": torch.zeros(70), "h": torch.zeros(5000, dtype=torch.bfloat16), "step": 0}


def test_direct_save_orders_data_before_manifest(tmp_path, direct_ok, monkeypatch):
    """Every data file is fsynced before the manifest's rename; the folder is fsynced after it."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = str(tmp_path / "ckpt")
    st = LocalStorage(path, direct=True, direct_buffer_size=BUF)
    state = _state(1)
    sp.save(st, state)
    commit = events.index(("replace", os.path.join(path, "manifest.json")))
    data_files = [p for k, p in events if k == "fsync" and p.endswith(".bin")]
    assert data_files and all(events.index(("fsync", p)) < commit for p in data_files)
    assert ("fsync", path) in events[commit + 1 :]
    assert st.direct_fallback_reason is None
    out = sp.load(path, _fresh())
    assert _same(state, out)


@pytest.mark.parametrize("buffers", [1, 2])
def test_failed_direct_save_keeps_the_previous_checkpoint(tmp_path, direct_ok, monkeypatch, buffers):
    path = str(tmp_path / "ckpt")
    old = _state(1)
    sp.save(LocalStorage(path, direct=True, direct_buffer_size=BUF, direct_buffers=buffers), old)
    manifest = open(os.path.join(path, "manifest.json"), "rb").read()
    files = sorted(os.listdir(os.path.join(path, "data")))
    real = _fail_direct_writes(monkeypatch, errno.ENOSPC, "No space left on device (injected)")
    with pytest.raises(StorageError, match=r"No space left on device \(injected\)"):
        sp.save(LocalStorage(path, direct=True, direct_buffer_size=BUF, direct_buffers=buffers), _state(2))
    monkeypatch.setattr(os, "pwrite", real)
    assert open(os.path.join(path, "manifest.json"), "rb").read() == manifest
    assert sorted(os.listdir(os.path.join(path, "data"))) == files  # the partial file was removed
    out = sp.load(path, _fresh())
    assert _same(old, out)


_KILLED_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import torch
    import shardpoint as sp
    from shardpoint.storage import LocalStorage
    from tests.storage.test_local import _state

    path, fresh = sys.argv[1], sys.argv[2]
    real = os.pwrite
    calls = [0]

    def pwrite(fd, data, offset):
        n = real(fd, data, offset)
        if STAGE[0] == "second":
            calls[0] += 1
            if calls[0] == 3:
                print("MID", flush=True)  # O_DIRECT blocks are on disk, the manifest is not
                time.sleep(60)
        return n

    STAGE = ["first"]
    os.pwrite = pwrite
    sp.save(LocalStorage(path, direct=True, direct_buffer_size=16384, direct_buffers=1), _state(1))
    STAGE[0] = "second"
    print("FIRST", flush=True)
    target = fresh if fresh != "-" else path
    sp.save(LocalStorage(target, direct=True, direct_buffer_size=16384, direct_buffers=1), _state(2))
    print("NOT KILLED", flush=True)
    """
)


def test_killed_direct_save_is_atomic(tmp_path, direct_ok):
    """SIGKILL in the middle of O_DIRECT data writes: the old checkpoint loads, a new path is incomplete."""
    path, fresh = str(tmp_path / "ckpt"), str(tmp_path / "new")
    script = tmp_path / "child.py"
    script.write_text(_KILLED_CHILD.format(repo=REPO))
    for target in ("-", fresh):
        p = subprocess.Popen([sys.executable, str(script), path, target], stdout=subprocess.PIPE, text=True, cwd=REPO)
        lines = []
        try:
            for line in p.stdout:
                lines.append(line.strip())
                if line.strip() == "MID":
                    os.kill(p.pid, signal.SIGKILL)
                    break
        finally:
            p.wait(timeout=60)
        assert lines == ["FIRST", "MID"], lines
        assert p.returncode == -signal.SIGKILL
        out = sp.load(path, _fresh())  # the committed checkpoint, never a torn one
        assert _same(_state(1), out)
        assert len(os.listdir(os.path.join(path, "data"))) >= 1
    # The interrupted save into a new folder left data but no manifest: not a checkpoint.
    assert os.listdir(os.path.join(fresh, "data")) and not os.path.exists(os.path.join(fresh, "manifest.json"))
    with pytest.raises(IncompleteCheckpointError):
        sp.load(fresh, _fresh())


def test_data_files_stay_open_for_reads_and_close_on_delete(tmp_path):
    import pickle

    st = LocalStorage(str(tmp_path / "k"))
    with st.open_writer("data/a.bin") as w:
        w.write(b"0123456789")
    buf = bytearray(4)
    st.readinto("data/a.bin", 3, memoryview(buf))
    assert bytes(buf) == b"3456"
    path = os.path.join(st.root, "data", "a.bin")
    assert list(st._reads.fds) == [path]
    fd = st._reads.fds[path]
    os.fstat(fd)  # open
    # A pickled copy (sent to another process) carries no descriptors.
    assert pickle.loads(pickle.dumps(st))._reads.fds == {}
    st.delete("data/a.bin")
    assert st._reads.fds == {}
    with pytest.raises(OSError):
        os.fstat(fd)


def test_replaced_files_are_read_afresh(tmp_path):
    st = LocalStorage(str(tmp_path / "k"))
    st.put_atomic("manifest.json", b"old!")
    buf = bytearray(4)
    st.readinto("manifest.json", 0, memoryview(buf))
    st.put_atomic("manifest.json", b"new!")  # a rename over the old file
    st.readinto("manifest.json", 0, memoryview(buf))
    assert bytes(buf) == b"new!" and st._reads.fds == {}
    # A data file rewritten through the storage is read afresh too.
    for body in (b"first", b"again"):
        with st.open_writer("data/b.bin") as w:
            w.write(body)
        got = bytearray(5)
        st.readinto("data/b.bin", 0, memoryview(got))
        assert bytes(got) == body
    st.close()
    assert st._reads.fds == {}
