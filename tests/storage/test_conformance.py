"""The contract every :class:`~shardpoint.storage.Storage` backend meets.

To test a new backend, subclass :class:`StorageConformance` and provide a
``make_storage`` fixture returning a factory of fresh, empty locations that do
not exist yet::

    class TestS3(StorageConformance):
        @pytest.fixture
        def make_storage(self, bucket):
            return lambda: S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}")

Backend-specific behaviour goes in the subclass.
"""

from __future__ import annotations

import array
import os
import threading

import numpy as np
import pytest

from shardpoint.errors import StorageError, UnsafeCheckpointError
from shardpoint.storage import LocalStorage, MemoryStorage, Storage, storage_for
from shardpoint.storage.locations import locate, relative_location


def write_file(st: Storage, name: str, *parts) -> int:
    with st.open_writer(name) as w:
        for p in parts:
            w.write(p)
    return sum(len(memoryview(p).cast("B")) for p in parts)


class StorageConformance:
    """Abstract: not collected by itself (no ``Test`` prefix)."""

    @pytest.fixture
    def make_storage(self):  # pragma: no cover - overridden
        raise NotImplementedError

    # --- writers and reads ---------------------------------------------------
    def test_writer_then_readinto(self, storage):
        payload = bytes(range(256)) * 3
        n = write_file(storage, "data/a.bin", payload[:100], memoryview(payload)[100:], b"")
        assert n == len(payload)
        assert storage.size("data/a.bin") == len(payload)
        buf = bytearray(50)
        storage.readinto("data/a.bin", 500, memoryview(buf))
        assert bytes(buf) == payload[500:550]
        assert storage.read("data/a.bin", 0, len(payload)) == payload
        assert storage.read("data/a.bin", 768, 0) == b""

    def test_typed_buffers(self, storage):
        data = np.arange(10, dtype=np.float32)
        write_file(storage, "f32.bin", memoryview(data), array.array("d", [1.5, -2.0]))
        assert storage.size("f32.bin") == 40 + 16
        out = np.zeros(10, dtype=np.float32)
        storage.readinto("f32.bin", 0, memoryview(out))
        assert np.array_equal(out, data)
        tail = np.zeros(2, dtype=np.float64)
        storage.readinto("f32.bin", 40, memoryview(tail))
        assert tail.tolist() == [1.5, -2.0]

    def test_short_read_raises(self, storage):
        # ShortReadError (a StorageError) is what the loader turns into CorruptCheckpointError
        from shardpoint.storage.base import ShortReadError

        write_file(storage, "s.bin", b"0123456789")
        with pytest.raises(ShortReadError, match=r"short read of s\.bin at 4: wanted 10 bytes, got 6"):
            storage.readinto("s.bin", 4, memoryview(bytearray(10)))
        with pytest.raises(ShortReadError, match="short read"):
            storage.read("s.bin", 11, 1)
        assert issubclass(ShortReadError, StorageError)

    def test_read_absent_is_file_not_found(self, storage):
        with pytest.raises(FileNotFoundError):
            storage.readinto("nope.bin", 0, memoryview(bytearray(1)))
        with pytest.raises(FileNotFoundError):
            storage.get("nope.bin")
        with pytest.raises(FileNotFoundError):
            storage.size("nope.bin")
        assert not storage.exists("nope.bin")

    def test_empty_file(self, storage):
        write_file(storage, "empty.bin")
        assert storage.exists("empty.bin")
        assert storage.size("empty.bin") == 0
        assert storage.read("empty.bin", 0, 0) == b""

    def test_writer_replaces(self, storage):
        write_file(storage, "r.bin", b"long old content")
        write_file(storage, "r.bin", b"new")
        assert storage.size("r.bin") == 3
        assert storage.read("r.bin", 0, 3) == b"new"

    def test_aborted_writer_leaves_nothing(self, storage):
        with pytest.raises(RuntimeError, match="boom"):
            with storage.open_writer("data/partial.bin") as w:
                w.write(b"x" * 1000)
                raise RuntimeError("boom")
        assert not storage.exists("data/partial.bin")
        assert "data/partial.bin" not in storage.list()
        w = storage.open_writer("data/p2.bin")
        w.write(b"abc")
        w.abort()
        w.abort()  # idempotent, never raises
        assert not storage.exists("data/p2.bin")

    def test_interleaved_writers(self, storage):
        a, b = storage.open_writer("a.bin"), storage.open_writer("b.bin")
        for i in range(5):
            a.write(bytes([i]) * 3)
            b.write(bytes([100 + i]))
        a.close()
        b.close()
        assert storage.read("a.bin", 0, 15) == b"".join(bytes([i]) * 3 for i in range(5))
        assert storage.read("b.bin", 0, 5) == bytes(range(100, 105))

    def test_concurrent_readers(self, storage):
        payload = os.urandom(4096)
        write_file(storage, "c.bin", payload)
        errors = []

        def worker(k):
            try:
                for i in range(20):
                    off = (k * 97 + i * 31) % 4000
                    assert storage.read("c.bin", off, 64) == payload[off : off + 64]
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert errors == []

    # --- small objects -------------------------------------------------------------
    def test_get_limited_checks_the_size_before_reading(self, storage):
        storage.put_atomic("manifest.json", b"0123456789")
        assert storage.get_limited("manifest.json", 10) == b"0123456789"
        assert storage.get_limited("manifest.json", 1 << 20) == b"0123456789"
        with pytest.raises(UnsafeCheckpointError, match=r"manifest.json is 10 bytes, over the format's limit of 9"):
            storage.get_limited("manifest.json", 9)
        with pytest.raises(FileNotFoundError):
            storage.get_limited("absent.json", 100)

    def test_put_atomic_get(self, storage):
        storage.put_atomic("manifest.json", b'{"a":1}')
        assert storage.get("manifest.json") == b'{"a":1}'
        assert storage.size("manifest.json") == 7
        storage.put_atomic("manifest.json", b"{}")
        assert storage.get("manifest.json") == b"{}"
        storage.put_atomic("sub/dir/m.json", b"x")
        assert storage.get("sub/dir/m.json") == b"x"
        # put_atomic leaves no side files behind
        assert storage.list() == ["manifest.json", "sub/dir/m.json"]

    # --- listing and deletion ------------------------------------------------------
    def test_list_sorted_recursive_with_prefix(self, storage):
        for name in ["b.txt", "data/z.bin", "data/a.bin", "a/x", "a/y/z", "ab"]:
            storage.put_atomic(name, name.encode())
        assert storage.list() == ["a/x", "a/y/z", "ab", "b.txt", "data/a.bin", "data/z.bin"]
        assert storage.list("data/") == ["data/a.bin", "data/z.bin"]
        assert storage.list("a/") == ["a/x", "a/y/z"]
        assert storage.list("a") == ["a/x", "a/y/z", "ab"]
        assert storage.list("zzz") == []

    def test_list_of_missing_location_is_empty(self, storage):
        assert storage.list() == []
        assert storage.list("data/") == []

    def test_delete(self, storage):
        storage.put_atomic("d/x", b"1")
        storage.put_atomic("d/y", b"2")
        storage.delete("d/x")
        assert storage.list() == ["d/y"]
        storage.delete("d/x")  # absent: ignored
        storage.delete("never/was")
        storage.delete_many(["d/y", "d/x"])
        assert storage.list() == []

    def test_location_exists(self, storage):
        assert not storage.location_exists()
        storage.put_atomic("m.json", b"{}")
        assert storage.location_exists()

    # --- sub-locations -----------------------------------------------------------------
    def test_child_shares_objects(self, storage):
        step = storage.child("step_1")
        assert not step.location_exists()
        step.put_atomic("manifest.json", b"m")
        write_file(step, "data/0.bin", b"abc")
        assert step.location_exists()
        assert step.list() == ["data/0.bin", "manifest.json"]
        assert storage.list() == ["step_1/data/0.bin", "step_1/manifest.json"]
        assert storage.get("step_1/manifest.json") == b"m"
        assert storage.read("step_1/data/0.bin", 1, 2) == b"bc"
        assert storage.child("step_1").get("manifest.json") == b"m"
        other = storage.child("step_2")
        assert other.list() == [] and not other.location_exists()
        storage.delete("step_1/manifest.json")
        assert step.list() == ["data/0.bin"]

    def test_nested_child(self, storage):
        storage.child("a").child("b").put_atomic("x", b"1")
        assert storage.list() == ["a/b/x"]
        assert storage.child("a").list() == ["b/x"]

    # --- counters -------------------------------------------------------------------------
    def test_stats_counters(self, storage):
        s = storage.stats
        assert (s.bytes_written, s.writes, s.bytes_read, s.reads) == (0, 0, 0, 0)
        write_file(storage, "a.bin", b"abc", b"defghij")
        storage.put_atomic("m.json", b"12345")
        assert (s.bytes_written, s.writes) == (15, 3)
        storage.read("a.bin", 2, 4)
        storage.get("m.json")
        assert (s.bytes_read, s.reads) == (9, 2)
        storage.size("a.bin")
        storage.list()
        assert (s.bytes_read, s.reads) == (9, 2)  # metadata is not data

    def test_create_exclusive(self, storage):
        assert storage.create_exclusive("sub/.claim", b"one")
        assert not storage.create_exclusive("sub/.claim", b"two")
        assert storage.get("sub/.claim") == b"one"
        storage.delete("sub/.claim")
        assert storage.create_exclusive("sub/.claim", b"three") and storage.get("sub/.claim") == b"three"

    def test_create_exclusive_races(self, storage):
        """Threads racing to create one name: exactly one wins where the backend says it is atomic."""
        wins: list[int] = []
        barrier = threading.Barrier(4)

        def go(i: int) -> None:
            barrier.wait()
            if storage.create_exclusive(".claim", str(i).encode()):
                wins.append(i)

        ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if storage.atomic_create:
            assert len(wins) == 1 and storage.get(".claim") == str(wins[0]).encode(), wins
        else:
            assert wins and storage.get(".claim") in {str(i).encode() for i in range(4)}

    def test_replace_if(self, storage):
        storage.put_atomic(".claim", b"old")
        assert not storage.replace_if(".claim", b"other", b"new")
        assert storage.get(".claim") == b"old"
        assert storage.replace_if(".claim", b"old", b"new")
        assert storage.get(".claim") == b"new"
        assert not storage.replace_if(".claim", b"old", b"newer")
        assert not storage.replace_if("absent", b"old", b"x") and not storage.exists("absent")

    def test_modified_times(self, storage):
        import time

        before = time.time()
        write_file(storage, "data/a.bin", b"abc")
        storage.put_atomic("manifest.json", b"{}")
        times = storage.modified_times("data/")
        assert list(times) == ["data/a.bin"]
        assert times["data/a.bin"] is not None and abs(times["data/a.bin"] - before) < 60
        assert storage.modified_times("nothing/") == {}

    def test_deletes_made_durable_and_empty_folders_removed_keep_every_file(self, storage):
        write_file(storage, "data/a.bin", b"abc")
        write_file(storage, "data/deep/b.bin", b"de")
        storage.put_atomic("manifest.json", b"{}")
        storage.delete("manifest.json")
        storage.sync_deletes()
        storage.delete("data/deep/b.bin")
        storage.remove_empty_folders()
        assert storage.list("") == ["data/a.bin"] and storage.get("data/a.bin") == b"abc"
        storage.delete("data/a.bin")
        storage.remove_empty_folders()
        assert storage.list("") == []

    def test_child_shares_stats(self, storage):
        c = storage.child("sub")
        c.put_atomic("x", b"1234")
        c.get("x")
        assert storage.stats.bytes_written == 4 and storage.stats.bytes_read == 4
        assert c.stats is storage.stats

    def test_sibling_locations(self, storage):
        # What an incremental checkpoint's references need: name a sibling relative to itself, and open it.
        a, b = storage.child("run/a"), storage.child("run/b")
        b.put_atomic("data/x.bin", b"base bytes")
        if a.place() is None:
            pytest.skip(f"{type(a).__name__} names no places: incremental saves refuse a base there")
        assert relative_location(a, b) == "../b"
        there = locate(a, "../b")
        assert there.get("data/x.bin") == b"base bytes" and there.place() == b.place()
        assert relative_location(a, storage_for(MemoryStorage()).child("b")) is None  # another tree

    def test_is_a_storage(self, storage):
        assert isinstance(storage, Storage)
        assert isinstance(storage.url, str) and storage.url
        assert storage_for(storage) is storage
        assert type(storage).__name__ in repr(storage)


class TestLocalStorage(StorageConformance):
    @pytest.fixture
    def make_storage(self, tmp_path):
        counter = iter(range(1_000_000))
        return lambda: LocalStorage(str(tmp_path / f"loc{next(counter)}" / "ckpt"))

    def test_unsafe_names_refused(self, storage):
        for bad in ["../x", "a/../../x", "/etc/passwd"]:
            with pytest.raises(StorageError, match="refusing unsafe name"):
                storage.put_atomic(bad, b"x")
            with pytest.raises(StorageError, match="refusing unsafe name"):
                storage.open_writer(bad)

    def test_files_on_disk(self, storage, tmp_path):
        write_file(storage, "data/a.bin", b"hello")
        storage.put_atomic("manifest.json", b"{}")
        with open(os.path.join(storage.root, "data", "a.bin"), "rb") as f:
            assert f.read() == b"hello"
        assert sorted(os.listdir(storage.root)) == ["data", "manifest.json"]

    def test_remove_empty_folders_removes_the_folder_itself(self, storage):
        write_file(storage, "data/deep/a.bin", b"x")
        os.makedirs(os.path.join(storage.root, "empty", "deeper"))
        storage.remove_empty_folders()
        assert sorted(os.listdir(storage.root)) == ["data"]
        storage.delete("data/deep/a.bin")
        storage.remove_empty_folders()
        assert not os.path.exists(storage.root) and not storage.location_exists()

    def test_file_url_and_path_resolution(self, tmp_path):
        st = storage_for(f"file://{tmp_path}/u")
        assert isinstance(st, LocalStorage) and st.root == str(tmp_path / "u")
        st2 = storage_for(tmp_path / "p")
        assert isinstance(st2, LocalStorage) and st2.root == str(tmp_path / "p")


class TestMemoryStorage(StorageConformance):
    @pytest.fixture
    def make_storage(self):
        return MemoryStorage

    def test_instances_are_isolated(self):
        a, b = MemoryStorage(), MemoryStorage()
        a.put_atomic("x", b"1")
        assert b.list() == [] and not b.location_exists()

    def test_unsafe_child_refused(self, storage):
        with pytest.raises(StorageError, match="refusing unsafe sub-location"):
            storage.child("../up")


def test_storage_for_errors():
    with pytest.raises(StorageError, match=r"create shardpoint\.storage\.MemoryStorage\(\) once"):
        storage_for("memory://x")
    with pytest.raises(StorageError, match=r"no storage backend for scheme 'gopher'"):
        storage_for("gopher://host/x")
    with pytest.raises(StorageError, match="expected a path, URL or Storage, got int"):
        storage_for(3)
