"""The multipart writer: sequential writes buffered into parts, uploaded in parallel, completed on close."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

from ...errors import StorageError
from ..base import Writer
from .options import GROW_EVERY, MAX_PART, MAX_PARTS, S3StorageError
from .retry import error_code

if TYPE_CHECKING:
    from .storage import S3Storage

__all__ = ["S3Writer"]

log = logging.getLogger("shardpoint.storage.s3")


class S3Writer(Writer):
    """Buffers sequential writes into parts; uploads them in parallel; completes on close."""

    def __init__(self, storage: "S3Storage", name: str):
        self._st = storage
        self._name = name
        self._key = storage.key(name)
        o = storage.options
        self._part_size = o.part_size
        self._slots = threading.Semaphore(o.max_concurrency)
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        self._buf: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._futures: dict[int, Future] = {}
        self._total = 0
        self._state = "open"  # open -> closed | aborted
        self._checksum = None  # "CRC32" when botocore computes flexible checksums

    # --- buffers --------------------------------------------------------------
    def _take(self) -> bytearray:
        self._slots.acquire()
        with self._free_lock:
            while self._free:
                b = self._free.pop()
                if len(b) == self._part_size:
                    return b
        return bytearray(self._part_size)

    def _give(self, b: bytearray | None) -> None:
        if b is not None and len(b) == self._part_size:
            with self._free_lock:
                self._free.append(b)
        self._slots.release()

    # --- writing ----------------------------------------------------------------
    def write(self, data) -> None:
        if self._state != "open":
            raise StorageError(f"{self._st.url}: write to {self._name} after close or abort")
        self._raise_failed_part()
        mv = memoryview(data).cast("B")
        n, pos = len(mv), 0
        while pos < n:
            if self._buf is None:
                self._buf, self._fill = self._take(), 0
            k = min(len(self._buf) - self._fill, n - pos)
            self._buf[self._fill : self._fill + k] = mv[pos : pos + k]
            self._fill += k
            pos += k
            if self._fill == len(self._buf):
                self._submit(final=False)
        self._total += n
        self._st.stats.add_write(n)

    def _start_upload(self) -> None:
        c = self._st.shared.client
        if getattr(c.meta.config, "request_checksum_calculation", "when_required") == "when_supported":
            self._checksum = "CRC32"
        kw = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        resp = self._st.call(
            "CreateMultipartUpload", self._name,
            lambda: c.create_multipart_upload(Bucket=self._st.bucket, Key=self._key, **kw),
        )
        self._upload_id = resp["UploadId"]

    def _submit(self, final: bool) -> None:
        buf, fill = self._buf, self._fill
        self._buf, self._fill = None, 0
        assert buf is not None
        if fill < len(buf):  # the last part: trim in place (no copy)
            del buf[fill:]
        if self._upload_id is None:
            try:
                self._start_upload()
            except BaseException:
                self._give(buf)
                raise
        pn = self._next_part
        if pn > MAX_PARTS:
            self._give(buf)
            raise S3StorageError(f"{self._st.url}: {self._name} needs more than {MAX_PARTS} parts; raise part_size")
        self._next_part += 1
        fut = self._st.shared.pool.submit(self._upload_part, pn, buf)
        fut.add_done_callback(lambda _f, b=buf: self._give(b))
        self._futures[pn] = fut
        if not final and pn % GROW_EVERY == 0:
            self._part_size = min(self._part_size * 2, MAX_PART)

    def _upload_part(self, pn: int, buf: bytearray) -> dict:
        c = self._st.shared.client
        kw = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        resp = self._st.call(
            "UploadPart", self._name,
            lambda: c.upload_part(
                Bucket=self._st.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=pn, Body=buf, **kw
            ),
        )
        part = {"PartNumber": pn, "ETag": resp["ETag"]}
        if self._checksum and resp.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = resp["ChecksumCRC32"]
        return part

    def _raise_failed_part(self) -> None:
        for fut in self._futures.values():
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def close(self) -> None:
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise StorageError(f"{self._st.url}: close of {self._name} after abort")
        try:
            self._close()
        except BaseException:
            self.abort()  # never leave a half-made upload behind
            raise

    def _close(self) -> None:
        st = self._st
        c = st.shared.client
        if self._upload_id is None:
            # Small file: one PUT.
            body = self._buf if self._buf is not None else bytearray()
            if self._buf is not None:
                del body[self._fill :]
            try:
                st.call("PutObject", self._name, lambda: c.put_object(Bucket=st.bucket, Key=self._key, Body=body))
            finally:
                if self._buf is not None:
                    self._buf = None
                    self._slots.release()
            self._state = "closed"
            return
        if self._buf is not None and self._fill:
            self._submit(final=True)
        elif self._buf is not None:
            self._give(self._buf)
            self._buf = None
        wait(list(self._futures.values()))
        self._raise_failed_part()
        parts = [self._futures[pn].result() for pn in sorted(self._futures)]
        upload_id = self._upload_id

        def complete():
            try:
                return c.complete_multipart_upload(
                    Bucket=st.bucket, Key=self._key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
            except Exception as e:
                # A retried completion whose first try succeeded: the upload is gone, the object is there.
                if error_code(e)[0] == "NoSuchUpload" and self._completed_already():
                    return {}
                raise

        st.call("CompleteMultipartUpload", self._name, complete)
        self._state = "closed"
        self._futures.clear()
        self._free.clear()

    def _completed_already(self) -> bool:
        try:
            head = self._st.shared.client.head_object(Bucket=self._st.bucket, Key=self._key)
        except Exception:  # noqa: BLE001
            return False
        return head.get("ContentLength") == self._total

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            for fut in self._futures.values():
                fut.cancel()
            wait(list(self._futures.values()))
            if self._buf is not None:
                self._buf = None
                self._slots.release()
            if self._upload_id is not None:
                st, uid = self._st, self._upload_id
                c = st.shared.client
                st.call(
                    "AbortMultipartUpload", self._name,
                    lambda: c.abort_multipart_upload(Bucket=st.bucket, Key=self._key, UploadId=uid),
                    ok_codes=("NoSuchUpload",),
                )
        except Exception as e:  # noqa: BLE001 - abort never raises
            log.warning("%s: aborting the upload of %s failed (%s); S3 lifecycle rules can clean it up",
                        self._st.url, self._name, e)
        finally:
            self._futures.clear()
            self._free.clear()
