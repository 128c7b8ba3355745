"""Serving memory copies to other hosts over the process group during a restore.

On separate machines a rank cannot open another host's memory folder. Each
rank therefore runs a small server thread for the length of a restore: a
request (file, offset, length) arrives on one private gloo group, and the
bytes go back on a second one. :class:`RemoteFolder` is the client side, a
read-only :class:`~shardpoint.storage.Storage` that the restore's
:class:`~shardpoint.peer.routed.RoutedStorage` reads a peer's files through,
so each byte a rank needs crosses the network once, and only the bytes it needs.

Example::

    with PeerServer(comm, own_folder, names) as srv:
        st = RemoteFolder(srv, server_rank=2, sizes=manifest.files)
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from typing import Mapping, Sequence

import numpy as np
import torch

from ..dist import Comm, destroy_private_group, private_group
from ..errors import StorageError
from ..storage.base import Storage, Writer

__all__ = ["PeerServer", "RemoteFolder"]

_STOP = -1
_OK, _MISSING = 0, 1


class PeerServer:
    """Serves byte ranges of this host's step folder to other ranks until :meth:`close`. Collective to create and close."""

    def __init__(self, comm: Comm, folder: Storage | None, names: Sequence[str], timeout: float | None = None):
        self.comm = comm
        self.folder = folder
        self.names = list(names)
        self.ids = {n: i for i, n in enumerate(self.names)}
        self.req = private_group(comm, timeout)
        self.resp = private_group(comm, timeout)
        self._tags = itertools.count(1)
        self._lock = threading.Lock()
        self.served = 0
        self.busy = 0.0  # seconds the server thread spent answering requests
        self._thread = threading.Thread(target=self._serve, name="shardpoint-peer-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        hdr = torch.empty(5, dtype=torch.int64)
        while True:
            src = self.req.recv_any(hdr)
            tag, fid, off, n, _ = (int(x) for x in hdr)
            if tag == _STOP:
                return
            t0 = time.monotonic()
            status = torch.tensor([_OK], dtype=torch.int64)
            try:
                if self.folder is None:
                    raise FileNotFoundError(self.names[fid])
                buf = self._bytes(self.names[fid], off, n)
            except (OSError, StorageError):
                status[0] = _MISSING
                buf = torch.zeros(n, dtype=torch.uint8)  # the reader posted its receive: it gets n bytes regardless
            self.resp.send(status, src, tag=2 * tag)
            self.resp.send(buf, src, tag=2 * tag + 1)
            del buf  # a mapped view: released before the next request
            if status[0] == _OK:
                self.served += n
            self.busy += time.monotonic() - t0

    def _bytes(self, name: str, off: int, n: int) -> torch.Tensor:
        """``n`` bytes of ``name`` from ``off``: a view of the file's mapping where there is one
        (sent from the host's memory with no copy and no new buffer), else read into a new buffer."""
        assert self.folder is not None
        view = self.folder.map_range(name, off, n)
        if view is not None:
            self.folder.populate(name, off, n)  # map every page now, not one fault per 4 KiB while sending
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping: sending only reads it
                return torch.frombuffer(view, dtype=torch.uint8)
        buf = torch.empty(n, dtype=torch.uint8)
        self.folder.readinto(name, off, memoryview(buf.numpy()))
        return buf

    def fetch(self, server: int, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``name`` at ``offset`` as held by group rank ``server``; ``FileNotFoundError`` if it lacks it.

        Both receives are posted before the request goes out, so the bytes
        flow as soon as the server sends them (one round trip, not two).
        """
        with self._lock:
            tag = next(self._tags)
        out = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
        status = torch.empty(1, dtype=torch.int64)
        got = [self.resp.irecv(status, server, tag=2 * tag), self.resp.irecv(out, server, tag=2 * tag + 1)]
        hdr = torch.tensor([tag, self.ids[name], offset, len(out), self.comm.rank], dtype=torch.int64)
        self.req.send(hdr, server)
        for w in got:
            w.wait()
        if int(status[0]) != _OK:
            raise FileNotFoundError(f"rank {server} holds no readable copy of {name}")

    def close(self) -> None:
        """Stop serving once every rank is done reading (a barrier, then one stop message per server)."""
        c = self.comm
        c.barrier()
        nxt = (c.rank + 1) % c.world
        self.req.send(torch.tensor([_STOP, 0, 0, 0, c.rank], dtype=torch.int64), nxt)
        self._thread.join()
        c.barrier()
        destroy_private_group(self.req)  # joined here, not at interpreter exit (see destroy_private_group)
        destroy_private_group(self.resp)

    def __enter__(self) -> "PeerServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteFolder(Storage):
    """A peer host's step folder, read through that host's :class:`PeerServer` (read-only)."""

    def __init__(self, server: PeerServer, rank: int, sizes: Mapping[str, int], url: str):
        super().__init__()
        self.server, self.rank, self.sizes, self.url = server, rank, dict(sizes), url

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        self.server.fetch(self.rank, name, offset, mv)
        self.stats.add_read(len(mv))

    def size(self, name: str) -> int:
        if name not in self.sizes:
            raise FileNotFoundError(f"{self.url}: {name}")
        return int(self.sizes[name])

    def get(self, name: str) -> bytes:
        buf = bytearray(self.size(name))
        self.readinto(name, 0, memoryview(buf))
        return bytes(buf)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.sizes if n.startswith(prefix))

    def location_exists(self) -> bool:
        return True

    def open_writer(self, name: str) -> Writer:
        raise StorageError(f"{self.url}: a peer's copy is read-only")

    def put_atomic(self, name: str, data: bytes) -> None:
        raise StorageError(f"{self.url}: a peer's copy is read-only")

    def delete(self, name: str) -> None:
        raise StorageError(f"{self.url}: a peer's copy is read-only")

    def child(self, sub: str) -> "Storage":
        raise StorageError(f"{self.url}: no sub-locations")
