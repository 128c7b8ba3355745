"""An S3 server on loopback for tests (moto in server mode) and a fault-injecting HTTP proxy.

The client always speaks real HTTP: :func:`moto_server` starts moto's
threaded server on ``127.0.0.1`` and a free port; :class:`FaultProxy` sits
between the client and that server and, on a scripted schedule, answers with
an S3 error, resets the connection halfway through a request body, or cuts a
response body short. No boto3 code is patched.

Example::

    with moto_server() as endpoint, FaultProxy(endpoint) as proxy:
        proxy.faults = lambda req: ("status", 503, "SlowDown") if req.index % 3 == 0 else None
        st = S3Storage("s3://bkt/x", s3_options(proxy.endpoint))
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["free_port", "moto_server", "s3_options", "make_bucket", "FaultProxy", "Request"]

ACCESS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Run moto's S3 server in this process on 127.0.0.1; yield its endpoint URL; always stop it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str, **kw):
    """Options for the loopback server: fixed test credentials, fast retries, small parts."""
    from shardpoint.storage import S3Options

    base = dict(ACCESS, endpoint_url=endpoint, part_size=5 << 20, read_part_size=1 << 20,
                max_concurrency=4, backoff_base=0.01, backoff_max=0.05)
    base.update(kw)
    return S3Options(**base)


def make_bucket(endpoint: str, name: str | None = None) -> str:
    import boto3

    name = name or f"b{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
    return name


@dataclass
class Request:
    """What the proxy knows about a request when it decides on a fault."""

    index: int  # 0-based count of requests through the proxy
    method: str
    target: str  # path and query
    length: int  # Content-Length (0 if absent)

    @property
    def op(self) -> str:
        """A rough S3 operation name: UploadPart, PutObject, GetObject, ..."""
        q = self.target.partition("?")[2]
        if self.method == "PUT":
            return "UploadPart" if "partNumber=" in q else ("CreateBucket" if self.target.count("/") == 1 else "PutObject")
        if self.method == "POST":
            return "CreateMultipartUpload" if "uploads" in q.split("&") else (
                "CompleteMultipartUpload" if "uploadId=" in q else "DeleteObjects")
        if self.method == "GET":
            return "ListObjects" if "list-type" in q or self.target.count("/") == 1 else "GetObject"
        if self.method == "DELETE":
            return "AbortMultipartUpload" if "uploadId=" in q else "DeleteObject"
        return self.method


# An action: None (forward), ("status", http_status, s3_code), ("reset_body", fraction),
# or ("cut_response", fraction).
Action = tuple | None


class FaultProxy:
    """A threaded HTTP/1.1 forwarder on 127.0.0.1 that injects faults chosen by ``faults``.

    Every connection carries one request: the proxy answers ``Expect:
    100-continue`` itself, forwards the request with ``Connection: close``, and
    relays the response with ``Connection: close``. ``log`` records
    ``(Request, action)`` for every request.
    """

    def __init__(self, upstream: str):
        m = re.match(r"http://([^:/]+):(\d+)", upstream)
        assert m, upstream
        self.upstream = (m.group(1), int(m.group(2)))
        self.faults: Callable[[Request], Action] = lambda req: None
        self.log: list[tuple[Request, Action]] = []
        self._lock = threading.Lock()
        self._count = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)  # so that stop() is noticed promptly
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=5)

    def injected(self, kind: str | None = None) -> list[tuple[Request, Action]]:
        with self._lock:
            return [(r, a) for r, a in self.log if a is not None and (kind is None or a[0] == kind)]

    # --- serving ----------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(60)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        i = buf.index(b"\r\n\r\n") + 4
        head = bytes(buf[:i])
        del buf[:i]
        return head

    @staticmethod
    def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
        while len(buf) < n:
            chunk = sock.recv(min(1 << 20, max(65536, n - len(buf))))
            if not chunk:
                raise ConnectionError("client closed mid-body")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _read_chunked(self, sock: socket.socket, buf: bytearray) -> bytes:
        out = bytearray()
        while True:
            while b"\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("client closed mid-body")
                buf += chunk
            i = buf.index(b"\r\n") + 2
            line = bytes(buf[:i])
            del buf[:i]
            out += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                # trailers until an empty line
                while True:
                    while b"\r\n" not in buf:
                        chunk = sock.recv(65536)
                        if not chunk:
                            raise ConnectionError("client closed mid-trailer")
                        buf += chunk
                    j = buf.index(b"\r\n") + 2
                    t = bytes(buf[:j])
                    del buf[:j]
                    out += t
                    if t == b"\r\n":
                        return bytes(out)
            out += self._read_exact(sock, buf, size + 2)

    def _handle(self, client: socket.socket) -> None:
        try:
            self._handle_one(client)
        except Exception:  # noqa: BLE001 - the client sees a dropped connection
            pass
        finally:
            with contextlib.suppress(OSError):
                client.close()

    def _handle_one(self, client: socket.socket) -> None:
        buf = bytearray()
        head = self._read_head(client, buf)
        if head is None:
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = [ln.split(":", 1) for ln in lines[1:] if ":" in ln]
        hmap = {k.strip().lower(): v.strip() for k, v in headers}
        length = int(hmap.get("content-length", "0") or 0)
        chunked = "chunked" in hmap.get("transfer-encoding", "").lower()
        with self._lock:
            req = Request(self._count, method, target, length)
            self._count += 1
        action = self.faults(req)
        with self._lock:
            self.log.append((req, action))
        if hmap.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if action and action[0] == "reset_body":
            self._read_exact(client, buf, int(length * action[1]))
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST
            return
        body = self._read_chunked(client, buf) if chunked else self._read_exact(client, buf, length)
        if action and action[0] == "status":
            status, code = action[1], action[2]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>").encode()
            reason = {500: "Internal Server Error", 503: "Slow Down", 403: "Forbidden"}.get(status, "Error")
            client.sendall(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(xml)}\r\n"
                f"Connection: close\r\n\r\n".encode() + (xml if method != "HEAD" else b"")
            )
            return
        keep = [f"{k}:{v}" for k, v in headers if k.strip().lower() not in ("expect", "connection")]
        out_head = "\r\n".join([lines[0], *keep, "Connection: close", "", ""]).encode("latin-1")
        with socket.create_connection(self.upstream, timeout=60) as up:
            up.sendall(out_head + body)
            resp = bytearray()
            while True:
                chunk = up.recv(1 << 20)
                if not chunk:
                    break
                resp += chunk
        i = resp.find(b"\r\n\r\n")
        if i < 0:
            client.sendall(resp)
            return
        rlines = resp[:i].decode("latin-1").split("\r\n")
        rlines = [ln for ln in rlines if not ln.lower().startswith("connection:")] + ["Connection: close"]
        rbody = bytes(resp[i + 4 :])
        rhead = ("\r\n".join(rlines) + "\r\n\r\n").encode("latin-1")
        if action and action[0] == "cut_response":
            client.sendall(rhead + rbody[: int(len(rbody) * action[1])])
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        client.sendall(rhead + rbody)
