"""The S3 backend against moto's server on loopback (real HTTP), with injected faults."""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from shardpoint.errors import StorageError
from shardpoint.storage import MissingDependencyError, S3Options, S3Storage, S3StorageError, storage_for
from shardpoint.storage.base import ShortReadError

from .s3_helpers import FaultProxy, s3_options
from .test_conformance import StorageConformance, write_file

pytest.importorskip("boto3")
pytest.importorskip("moto")


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as p:
        yield p


def _uploads(st: S3Storage) -> list:
    return st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads", [])


class TestS3Storage(StorageConformance):
    @pytest.fixture
    def make_storage(self, s3_endpoint, bucket):
        made = []

        def make():
            st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}/ckpt", s3_options(s3_endpoint))
            made.append(st)
            return st

        yield make
        for st in made:
            st.close()

    # --- S3 specifics ------------------------------------------------------------------
    def test_multipart_parallel_parts_and_ranged_reads(self, storage):
        payload = os.urandom(13 << 20)  # 5 + 5 + 3 MiB parts
        mv = memoryview(payload)
        with storage.open_writer("data/big.bin") as w:
            for i in range(0, len(payload), 3 << 20):  # writes that straddle part boundaries
                w.write(mv[i : i + (3 << 20)])
        head = storage.client.head_object(Bucket=storage.bucket, Key=storage.key("data/big.bin"))
        assert head["ContentLength"] == len(payload)
        assert head["ETag"].strip('"').endswith("-3")  # a 3-part multipart object
        out = np.empty(len(payload) - 12345, dtype=np.uint8)
        storage.readinto("data/big.bin", 12345, memoryview(out))  # 13 parallel ranged GETs
        assert out.tobytes() == payload[12345:]
        assert _uploads(storage) == []

    def test_short_read_across_ranges(self, storage):
        write_file(storage, "s.bin", os.urandom(3_500_000))
        with pytest.raises(ShortReadError, match="wanted 3000000 bytes, got 2500000"):
            storage.readinto("s.bin", 1_000_000, memoryview(bytearray(3_000_000)))

    def test_abort_aborts_the_multipart_upload(self, storage):
        w = storage.open_writer("data/x.bin")
        w.write(os.urandom(11 << 20))  # two parts in flight or done
        assert _uploads(storage), "a multipart upload should be open"
        w.abort()
        assert _uploads(storage) == []
        assert not storage.exists("data/x.bin")

    def test_put_atomic_is_one_put(self, storage, proxy):
        st = S3Storage(storage.url, storage.options, endpoint_url=proxy.endpoint)
        st.put_atomic("manifest.json", b"{}" * 1000)
        assert [r.op for r, _ in proxy.log] == ["PutObject"]

    def test_delete_many_batches(self, storage, proxy):
        st = S3Storage(storage.url, storage.options, endpoint_url=proxy.endpoint)
        names = [f"d/{i:04d}" for i in range(1005)]
        for n in names[:20]:
            st.put_atomic(n, b"x")
        proxy.log.clear()
        st.delete_many(names)
        assert [r.op for r, _ in proxy.log] == ["DeleteObjects", "DeleteObjects"]
        assert st.list() == []

    def test_list_paginates(self, storage, proxy):
        st = S3Storage(storage.url, storage.options, endpoint_url=proxy.endpoint, list_page_size=7)
        for i in range(20):
            st.put_atomic(f"p/{i:03d}", b"")
        proxy.log.clear()
        names = st.list("p/")
        assert names == [f"p/{i:03d}" for i in range(20)]
        assert [r.op for r, _ in proxy.log] == ["ListObjects"] * 3

    def test_children_share_client_and_pool(self, storage):
        c = storage.child("a").child("b")
        assert c.url == f"{storage.url}/a/b" and c.shared is storage.shared
        with pytest.raises(StorageError, match="refusing unsafe sub-location"):
            storage.child("../x")
        with pytest.raises(StorageError, match="refusing unsafe name"):
            storage.put_atomic("../x", b"1")

    def test_pickles_without_client(self, storage):
        import pickle

        storage.put_atomic("m", b"1")
        again = pickle.loads(pickle.dumps(storage.child("x")))
        assert again.url == f"{storage.url}/x" and again.options == storage.options
        assert pickle.loads(pickle.dumps(storage)).get("m") == b"1"

    def test_missing_bucket(self, s3_endpoint):
        st = S3Storage(f"s3://nobucket-{uuid.uuid4().hex[:8]}/x", s3_options(s3_endpoint))
        assert not st.location_exists() and st.list() == []
        with pytest.raises(FileNotFoundError):
            st.get("manifest.json")
        with pytest.raises(S3StorageError, match="does not exist") as ei:
            st.put_atomic("manifest.json", b"{}")
        assert ei.value.code == "NoSuchBucket"


# --- resolution, options and environment ----------------------------------------------------


def test_storage_for_s3_options(s3_endpoint, bucket):
    st = storage_for(f"s3://{bucket}/o/", endpoint_url=s3_endpoint, access_key_id="testing",
                     secret_access_key="testing", region="us-east-1", max_concurrency=3)
    assert isinstance(st, S3Storage) and st.url == f"s3://{bucket}/o" and st.options.max_concurrency == 3
    st.put_atomic("m", b"1")
    st2 = storage_for(f"s3://{bucket}/o", options=s3_options(s3_endpoint))
    assert st2.get("m") == b"1"
    with pytest.raises(TypeError, match="unknown S3 option"):
        storage_for(f"s3://{bucket}/o", endpoint="x")
    with pytest.raises(ValueError, match="part_size"):
        S3Options(part_size=1 << 20)
    with pytest.raises(StorageError, match="names no bucket"):
        S3Storage("s3:///x")
    assert "testing" not in repr(st.options) and "***" in repr(st.options)


def test_standard_aws_environment(s3_endpoint, bucket, monkeypatch, tmp_path):
    """No options: endpoint, credentials and region come from the AWS environment, as in boto3."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    st = storage_for(f"s3://{bucket}/env")
    st.put_atomic("m", b"env")
    assert st.get("m") == b"env"
    assert st.client.meta.region_name == "us-east-1"
    # A profile from the shared files.
    (tmp_path / "creds").write_text("[ckpt]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert S3Storage(f"s3://{bucket}/env", profile="ckpt").get("m") == b"env"
    # Explicit options override the environment.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    assert S3Storage(f"s3://{bucket}/env", s3_options(s3_endpoint)).get("m") == b"env"


def test_missing_boto3_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardpoint\[s3\]'") as ei:
        storage_for("s3://bucket/x")
    assert isinstance(ei.value, StorageError)


# --- faults -------------------------------------------------------------------------------------


def test_throttling_and_5xx_are_retried(proxy, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint))
    payload = os.urandom(12 << 20)

    def faults(req):
        if req.index % 4 == 1 and req.index < 24:
            return ("status", 503, "SlowDown") if req.index % 2 else ("status", 500, "InternalError")
        return None

    proxy.faults = faults
    write_file(st, "data/a.bin", payload)
    st.put_atomic("manifest.json", b"{}")
    assert st.read("data/a.bin", 0, len(payload)) == payload
    assert st.list() == ["data/a.bin", "manifest.json"]
    kinds = {r.op for r, _ in proxy.injected("status")}
    assert {"UploadPart", "GetObject"} <= kinds, kinds


def test_reset_mid_part_upload_is_retried(proxy, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint))
    payload = os.urandom(11 << 20)
    done = set()

    def faults(req):
        if req.op == "UploadPart" and "partNumber=2" in req.target and "p2" not in done:
            done.add("p2")
            return ("reset_body", 0.5)
        return None

    proxy.faults = faults
    write_file(st, "data/a.bin", payload)
    assert len(proxy.injected("reset_body")) == 1
    assert st.read("data/a.bin", 0, len(payload)) == payload


def test_reset_mid_response_body_is_retried(proxy, bucket):
    """A GET whose body is cut: botocore has already returned, so shardpoint's own retry reads it again."""
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint))
    payload = os.urandom(3 << 20)
    write_file(st, "a.bin", payload)
    cut = []

    def faults(req):
        if req.op == "GetObject" and len(cut) < 2:
            cut.append(req)
            return ("cut_response", 0.5)
        return None

    proxy.faults = faults
    assert st.read("a.bin", 0, len(payload)) == payload
    assert len(cut) == 2


def test_permanent_failure_is_typed_and_aborts(proxy, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint, retries=1, max_attempts=2))
    proxy.faults = lambda req: ("status", 500, "InternalError") if req.op == "UploadPart" else None
    with pytest.raises(S3StorageError, match=r"UploadPart of data/a\.bin failed after 2 attempts") as ei:
        write_file(st, "data/a.bin", os.urandom(11 << 20))
    assert ei.value.code == "InternalError" and ei.value.status == 500
    assert _uploads(st) == [] and st.list() == []
    # Not retryable at all: one request, then the typed error.
    proxy.log.clear()
    proxy.faults = lambda req: ("status", 403, "AccessDenied") if req.op == "PutObject" else None
    with pytest.raises(S3StorageError, match="check the credentials") as ei:
        st.put_atomic("manifest.json", b"{}")
    assert ei.value.code == "AccessDenied"
    assert [r.op for r, _ in proxy.log] == ["PutObject"]


# --- merged ranged reads ---------------------------------------------------------------------------


def _read_in_thread(st: S3Storage, name: str, lo: int, hi: int, out: dict) -> threading.Thread:
    def run():
        buf = bytearray(hi - lo)
        try:
            st.readinto(name, lo, memoryview(buf))
            out[(lo, hi)] = bytes(buf)
        except Exception as e:  # noqa: BLE001 - checked by the test
            out[(lo, hi)] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_pending(st: S3Storage, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(st.shared.reads._pending) < n:
        assert time.monotonic() < deadline, "reads did not queue up"
        time.sleep(0.005)


def _gets(proxy) -> int:
    return sum(1 for r, _ in proxy.log if r.op == "GetObject")


@pytest.fixture
def held(proxy):
    """Hold GETs at the proxy (the first one, or all while ``hold_all``) until ``release`` is set."""

    class Held:
        arrived = threading.Event()
        release = threading.Event()
        hold_all = False
        error: tuple | None = None  # an action for GETs after the first

    h = Held()
    h.seen = []  # GETs as they arrive (the proxy logs a request only after its fault decision)

    def faults(req):
        if req.op != "GetObject":
            return None
        first = not h.seen
        h.seen.append(req)
        if first or h.hold_all:
            h.arrived.set()
            h.release.wait(10)
            return None
        return h.error

    proxy.faults = faults
    yield h
    h.release.set()


def test_waiting_reads_of_one_object_share_a_get(proxy, bucket, held):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}",
                   s3_options(proxy.endpoint, max_concurrency=1, read_merge_gap=64 << 10))
    payload = os.urandom(3 << 20)
    write_file(st, "a.bin", payload)
    proxy.log.clear()
    out: dict = {}
    threads = [_read_in_thread(st, "a.bin", 0, 100_000, out)]
    assert held.arrived.wait(10)  # the only GET slot is taken
    spans = [(200_000, 300_000), (300_000, 300_050), (301_000, 900_000), (2_500_000, 2_600_000)]
    threads += [_read_in_thread(st, "a.bin", lo, hi, out) for lo, hi in spans]
    _wait_pending(st, len(spans))
    held.release.set()
    for t in threads:
        t.join(10)
    for (lo, hi), got in out.items():
        assert got == payload[lo:hi], (lo, hi)
    assert len(out) == 5
    # The first read, one GET for the three neighbours (gaps 0 and 950 bytes), one for the far read.
    assert _gets(proxy) == 3 and st.get_requests == 3


def test_small_read_rides_along_with_a_neighbour(proxy, bucket, held):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint, max_concurrency=4))
    payload = os.urandom(4 << 20)
    write_file(st, "a.bin", payload)
    proxy.log.clear()
    held.hold_all = True
    out: dict = {}
    big = _read_in_thread(st, "a.bin", 0, 2 << 20, out)  # two GETs, held
    deadline = time.monotonic() + 10
    while len(held.seen) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    small = _read_in_thread(st, "a.bin", (2 << 20) + 64, (2 << 20) + 1000, out)
    _wait_pending(st, 1)
    time.sleep(0.2)
    assert len(held.seen) == 2, "a small read of a busy object waits for company"
    held.hold_all = False
    large = _read_in_thread(st, "a.bin", (2 << 20) + 2000, 3 << 20, out)
    for t in (large, small):
        t.join(10)
    assert len(held.seen) == 3 and big.is_alive()  # done while the big read is still held
    held.release.set()
    big.join(10)
    assert {k: v == payload[k[0] : k[1]] for k, v in out.items()} == {
        (0, 2 << 20): True, ((2 << 20) + 64, (2 << 20) + 1000): True, ((2 << 20) + 2000, 3 << 20): True}
    assert _gets(proxy) == 3  # the small read went with the large one
    # With no neighbour coming, a held small read goes alone once the object is idle.
    lone = _read_in_thread(st, "a.bin", 10, 20, out)
    lone.join(10)
    assert out[(10, 20)] == payload[10:20] and _gets(proxy) == 4


def test_merged_get_failure_reaches_every_read(proxy, bucket, held):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}",
                   s3_options(proxy.endpoint, max_concurrency=1, retries=0, max_attempts=1))
    payload = os.urandom(1 << 20)
    write_file(st, "a.bin", payload)
    held.error = ("status", 403, "AccessDenied")
    out: dict = {}
    threads = [_read_in_thread(st, "a.bin", 0, 1000, out)]
    assert held.arrived.wait(10)
    threads += [_read_in_thread(st, "a.bin", lo, hi, out) for lo, hi in [(5000, 6000), (6000, 9000)]]
    _wait_pending(st, 2)
    held.release.set()
    for t in threads:
        t.join(10)
    assert out[(0, 1000)] == payload[:1000]
    for k in [(5000, 6000), (6000, 9000)]:
        assert isinstance(out[k], S3StorageError) and out[k].code == "AccessDenied", out[k]
        assert "GetObject of a.bin failed" in str(out[k])
    assert _gets(proxy) == 2


def test_short_reads_inside_a_merged_get(proxy, bucket, held):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint, max_concurrency=1))
    payload = os.urandom(1000)
    write_file(st, "s.bin", payload)
    out: dict = {}
    threads = [_read_in_thread(st, "s.bin", 0, 10, out)]
    assert held.arrived.wait(10)
    threads += [_read_in_thread(st, "s.bin", lo, hi, out) for lo, hi in [(100, 500), (900, 1100), (1200, 1300)]]
    _wait_pending(st, 3)
    held.release.set()
    for t in threads:
        t.join(10)
    assert out[(0, 10)] == payload[:10] and out[(100, 500)] == payload[100:500]
    assert isinstance(out[(900, 1100)], ShortReadError)
    assert "short read of s.bin at 900: wanted 200 bytes, got 100" in str(out[(900, 1100)])
    assert "short read of s.bin at 1200: wanted 100 bytes, got 0" in str(out[(1200, 1300)])
    assert st.get_requests == 2


def test_merging_off_splits_each_read_alone(s3_endpoint, bucket):
    storage = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(s3_endpoint))
    payload = os.urandom(int(2.2 * (1 << 20)))
    write_file(storage, "a.bin", payload)
    off = S3Storage(storage.url, storage.options, read_merge_gap=None)
    assert off.read("a.bin", 0, len(payload)) == payload
    assert off.get_requests == 3  # 1 + 1 + 0.2 MiB at read_part_size 1 MiB
    assert storage.read("a.bin", 0, len(payload)) == payload
    assert storage.get_requests == 2  # two equal GETs of 1.1 MiB (within 9/8 of a part)
    # The load engine joins runs of one chunk closer than this; off means only touching ones.
    assert storage.coalesce_bytes == 1 << 20 and off.coalesce_bytes == 0
    with pytest.raises(ValueError, match="read_merge_gap must be >= 0 or None, got -1"):
        S3Options(read_merge_gap=-1)
