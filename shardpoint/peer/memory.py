"""PeerMemory: checkpoints in the host memory of this host and of its peers.

Every ``interval`` steps the ranks save their shards into their host's
memory folder (a collective :func:`shardpoint.save`: each rank writes its
data and index files into its own host's folder, rank 0 writes the
manifest). Each rank then sends its files to one rank of each of
``replicas`` other hosts, chosen across failure domains
(:func:`~shardpoint.peer.plan.replica_hosts`), over the process group, in
pieces bounded by ``budget_bytes`` (a round of pieces must land before the
next is read: back-pressure). The manifest is written into every host's
folder last, so each host folder is a self-describing shardpoint checkpoint
of the files it holds. Once every rank's copies landed the step is complete
and each host drops its older steps: a folder holds at most two steps (the
complete one and the one being written).

A restore (in a restarted job, any world size) has every rank announce its
host, its folder and what the folder holds; all ranks then run the same
pure plan (:func:`~shardpoint.peer.plan.choose_memory_step`) and load the
newest complete step, each file from the first host holding a copy, own
host first, resharding to the current layout.

Example::

    mgr = sp.CheckpointManager("ckpt/run", interval=500, memory=sp.PeerMemory(replicas=1))
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Mapping, MutableMapping

import torch

from ..api import save as _sp_save
from ..saving.async_save import AsyncSaver
from ..dist import Comm, destroy_private_group, private_group
from ..errors import CheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.local import LocalStorage
from .plan import HostListing, StepCopy, choose_memory_step, transfers
from .restore import RestoreReport, folder_name, restore_step

__all__ = ["PeerMemory", "RestoreReport", "host_id", "default_memory_dir", "HOST_ENV", "DOMAIN_ENV"]

HOST_ENV = "SHARDPOINT_HOST"
"""Overrides the host name (tests and demos simulate several hosts on one machine)."""
DOMAIN_ENV = "SHARDPOINT_FAILURE_DOMAIN"
"""This host's failure domain (a rack, a power feed); default: the host itself."""

_STEP_RE = re.compile(r"^step_(\d{8,})$")


def host_id(env: Mapping[str, str] | None = None) -> str:
    """This process's host: ``SHARDPOINT_HOST``, else torchrun's node (``GROUP_RANK``, or
    ``RANK // LOCAL_WORLD_SIZE``), else the host name.

    Example::

        host_id({"SHARDPOINT_HOST": "h1"})  # 'h1'
    """
    env = os.environ if env is None else env
    if env.get(HOST_ENV):
        return env[HOST_ENV]
    if env.get("GROUP_RANK") not in (None, ""):
        return f"node{int(env['GROUP_RANK'])}"
    if env.get("LOCAL_WORLD_SIZE") and env.get("RANK"):
        return f"node{int(env['RANK']) // max(1, int(env['LOCAL_WORLD_SIZE']))}"
    return socket.gethostname()


def default_memory_dir(host: str) -> str:
    """``/dev/shm/shardpoint/<host>`` (the system temporary folder where there is no ``/dev/shm``)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "shardpoint", host)


_folder = folder_name


class _StepFolder(LocalStorage):
    """One host's folder of one memory step, named alike on every rank (the save's entry check compares names)."""

    def __init__(self, root: str, name: str):
        super().__init__(root)
        self.url = f"peer-memory:{name}"


class PeerMemory:
    """Checkpoints in host memory, replicated to the memory of peer hosts.

    Args:
        dir: this host's memory folder (default :func:`default_memory_dir`).
        replicas: how many other hosts keep a copy of each shard.
        interval: take a memory checkpoint every ``interval`` steps.
        budget_bytes: host memory for replication pieces in flight per rank.
        host: this host's name (default :func:`host_id`).
        mode: the snapshot: ``"eager"`` (copied into staging memory in the call, written in the
            background), ``"lazy"`` (copied as training goes on) or ``None`` (written in the call).
        staging_bytes: host staging memory of the snapshot (default: the asynchronous saver's).
        timeout: seconds after which a replication collective counts as failed (a peer died).

    Example::

        mem = sp.PeerMemory(replicas=1, interval=1)
        mgr = sp.CheckpointManager("ckpt/run", interval=100, memory=mem)
    """

    def __init__(self, dir: str | None = None, replicas: int = 1, interval: int = 1, *,
                 budget_bytes: int = 256 << 20, host: str | None = None, timeout: float | None = 600.0, mode: str | None = "eager",
                 staging_bytes: int | None = None):
        if int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if int(replicas) < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if int(budget_bytes) < 1 << 16:
            raise ValueError(f"budget_bytes must be >= 64 KiB, got {budget_bytes}")
        self.host = host or host_id()
        self.dir = os.path.abspath(dir or default_memory_dir(self.host))
        self.replicas = int(replicas)
        self.interval = int(interval)
        self.budget_bytes = int(budget_bytes)
        self.domain = os.environ.get(DOMAIN_ENV) or self.host
        self._table: list[tuple[str, str, str]] | None = None  # per rank: host, dir, domain
        self.last_save: dict[str, Any] = {}
        if mode not in ("eager", "lazy", None):
            raise ValueError(f"mode must be 'eager', 'lazy' or None, got {mode!r}")
        self.mode = mode
        self.staging_bytes = staging_bytes
        self._saver: AsyncSaver | None = None
        self.timeout = timeout
        self._rcomm: Comm | None = None  # private group of the background replication
        self._own_rcomm = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.kill_during_replication: int | None = None  # test-only: SIGKILL this process at this replication round

    def __repr__(self) -> str:
        return f"PeerMemory(dir={self.dir!r}, replicas={self.replicas}, interval={self.interval}, host={self.host!r})"

    def wants(self, step: int) -> bool:
        """Whether ``step`` gets a memory checkpoint."""
        return step % self.interval == 0

    def steps(self) -> list[int]:
        """Steps with a committed manifest in this host's folder (local, no collective)."""
        return sorted(c.step for c in self._listing().steps if c.manifest)

    # ----------------------------------------------------------- save
    def _hosts(self, comm: Comm) -> list[tuple[str, str, str]]:
        if self._table is None:
            self._table = comm.all_gather((self.host, self.dir, self.domain))
        return self._table

    def prewarm(self, comm: Comm, state: MutableMapping[str, Any] | None = None) -> None:
        """Make now what the first memory step would make: the host table, the replication group and the
        snapshot's saver (pre-warmed with ``state``, see :meth:`~shardpoint.AsyncSaver.prewarm`). Collective.

        :class:`~shardpoint.CheckpointManager` calls it on construction.
        """
        self._hosts(comm)
        if self._rcomm is None:
            self._rcomm = private_group(comm, self.timeout)
        if self.mode is not None:
            self._snapshot_saver(comm).prewarm(state)

    def _snapshot_saver(self, comm: Comm) -> AsyncSaver:
        if self._saver is None:
            kw = {} if self.staging_bytes is None else {"staging_bytes": int(self.staging_bytes)}
            self._saver = AsyncSaver(process_group=comm.group if comm.active else None, timeout=self.timeout, **kw)
        return self._saver

    def save(self, step: int, state: MutableMapping[str, Any], comm: Comm) -> None:
        """Snapshot ``step`` into this host's memory, then replicate and commit it in the background.

        Waits for the previous step's replication first (back-pressure: at
        most one step in flight). Collective.
        """
        self.wait()
        t0 = time.monotonic()
        table = self._hosts(comm)
        if self._rcomm is None:
            self._rcomm = private_group(comm, self.timeout)
            self._own_rcomm = self._rcomm is not comm
        name = _folder(step)
        st = _StepFolder(os.path.join(self.dir, name), name)
        group = comm.group if comm.active else None
        handle = None
        if self.mode is None:
            _sp_save(st, state, process_group=group)
        else:
            handle = self._snapshot_saver(comm).save(st, state, mode=self.mode)
        t1 = time.monotonic()
        self._thread = threading.Thread(target=self._background, args=(step, st, table, t0, t1, handle),
                                        name="shardpoint-peer-replicate", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the background replication of the last step; raise its error. Every rank calls it."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        e, self._error = self._error, None
        if e is not None:
            raise CheckpointError(f"rank {self._rcomm.rank if self._rcomm else 0}: replicating a memory "
                                  f"checkpoint to peer hosts failed: {e}") from e

    def close(self) -> None:
        """Wait for the replication in flight, then free the snapshot's staging memory and the private group.

        Local (no collective) and idempotent; a later save starts them again.
        """
        try:
            self.wait()
        finally:
            saver, self._saver = self._saver, None
            if saver is not None:
                saver.close()
            comm, self._rcomm = self._rcomm, None
            if self._own_rcomm:
                destroy_private_group(comm)
            self._own_rcomm = False

    def _background(self, step: int, st: "_StepFolder", table, t0: float, t1: float, handle: Any) -> None:
        try:
            if handle is not None:
                handle.wait()  # this host's copy written (an eager or lazy snapshot, then the write)
            self._commit(step, st, self._rcomm, table, t0, t1)
        except BaseException as e:  # noqa: BLE001 - raised by wait() on the caller's thread
            self._error = e

    def _commit(self, step: int, st: "_StepFolder", comm: Comm, table, t0: float, t1: float) -> None:
        mbytes = st.get(MANIFEST_NAME) if comm.rank == 0 else None
        mbytes = comm.broadcast(mbytes)
        man = Manifest.from_json(mbytes, st.url)
        rf = man.ranks[comm.rank] if comm.rank < len(man.ranks) else None
        mine = {} if rf is None else {n: man.files[n] for n in (rf.data, rf.index) if n in man.files}
        sent = self._replicate(st, comm, table, {r: sorted(f) for r, f in enumerate(comm.all_gather(mine))}, man.files)
        t2 = time.monotonic()
        firsts = {h: r for r, (h, _, _) in reversed(list(enumerate(table)))}
        if firsts[self.host] == comm.rank and not st.exists(MANIFEST_NAME):
            st.put_atomic(MANIFEST_NAME, mbytes)  # this host's copy is committed last
        oks = comm.all_gather(True)  # every copy landed: the step is complete everywhere
        if all(oks) and firsts[self.host] == comm.rank:
            self._prune(keep=step)
        self.last_save = {"step": step, "snapshot_s": t1 - t0, "replicate_s": t2 - t1,
                          "total_s": time.monotonic() - t0, "bytes_sent": sent}

    def _replicate(self, st: LocalStorage, comm: Comm, table, files: dict[int, list[str]], sizes: Mapping[str, int]) -> int:
        if self.replicas == 0 or not comm.active or comm.world == 1:
            return 0
        plan = transfers([h for h, _, _ in table], files, self.replicas, {h: d for h, _, d in table})
        me = comm.rank
        mine = [(i, t) for i, t in enumerate(plan) if t.src == me or t.dst == me]
        if not mine:
            return 0
        piece = max(1 << 16, self.budget_bytes // (2 * len(mine)))
        streams = {i: [(n, int(sizes[n])) for n in t.names] for i, t in mine}
        total = {i: sum(s for _, s in v) for i, v in streams.items()}
        rounds = max((total[i] + piece - 1) // piece for i, _ in mine)
        writers: dict[int, list] = {i: [None, 0, 0] for i, t in mine if t.dst == me}  # writer, file index, offset
        sent = 0
        for k in range(rounds):
            if self.kill_during_replication == k:
                os.kill(os.getpid(), signal.SIGKILL)
            ops, recvs = [], []
            for i, t in mine:
                lo = k * piece
                n = min(piece, total[i] - lo)
                if n <= 0:
                    continue
                if t.src == me:
                    buf = torch.from_numpy(_read_span(st, streams[i], lo, n))
                    ops.append(comm.isend(buf, t.dst, tag=i))
                    sent += n
                else:
                    buf = torch.empty(n, dtype=torch.uint8)
                    ops.append(comm.irecv(buf, t.src, tag=i))
                    recvs.append((i, buf))
            for op in ops:
                op.wait()
            for i, buf in recvs:
                _write_span(st, streams[i], writers[i], buf.numpy())
        return sent

    def _prune(self, keep: int) -> None:
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else ():
            m = _STEP_RE.match(name)
            if m and int(m.group(1)) != keep:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    # ------------------------------------------------------------ restore
    def _listing(self) -> HostListing:
        out = []
        names = sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []
        for name in names:
            m = _STEP_RE.match(name)
            if not m:
                continue
            st = LocalStorage(os.path.join(self.dir, name))
            try:
                files = {n: st.size(n) for n in st.list("") if n != MANIFEST_NAME}
            except OSError:
                continue
            needs, save_id, has = None, "", False
            try:
                man = Manifest.from_json(st.get(MANIFEST_NAME), st.url)
                save_id, has = man.save_id, True
                needs = {n: int(s) for n, s in man.files.items()}
            except (FileNotFoundError, CheckpointError, OSError, ValueError):
                pass
            if not has:
                save_id = "?"  # copies without a committed manifest never count (matched by save id)
            out.append(StepCopy(int(m.group(1)), save_id, files, needs, has))
        return HostListing(self.host, self.dir, tuple(out))

    def restore(self, state: MutableMapping[str, Any], comm: Comm, newer_than: int | None = None,
                **load_kwargs) -> RestoreReport | None:
        """Load the newest memory step complete on the live hosts (``>= newer_than``); ``None`` if none. Collective."""
        t0 = time.monotonic()
        gathered = comm.all_gather(self._listing()) if comm.active else [self._listing()]
        hosts: dict[str, HostListing] = {}
        for lst in gathered:
            hosts.setdefault(lst.host, lst)
        listings = list(hosts.values())
        choices = choose_memory_step(listings, self.host, newer_than)
        t_plan = time.monotonic() - t0
        for ch in choices:
            rep = restore_step(ch, gathered, state, comm, self.dir, self.host, load_kwargs, t0, t_plan)
            if rep is not None:
                self.forget_newer(rep.step, comm, gathered)
                return rep
        return None

    def forget_newer(self, step: int, comm: Comm, gathered: list[HostListing] | None = None) -> None:
        """After a restore of ``step``: drop this host's memory steps newer than it (torn ones of an abandoned run).

        Their files could never complete again, and a later save of the same
        step must not share a folder with them. Collective unless ``gathered``
        (every rank's listing) is given.
        """
        if gathered is None:
            gathered = comm.all_gather(HostListing(self.host, self.dir)) if comm.active else [HostListing(self.host, self.dir)]
        first = next(r for r, lst in enumerate(gathered) if lst.host == self.host)
        if first != comm.rank or not os.path.isdir(self.dir):
            return
        for name in os.listdir(self.dir):
            m = _STEP_RE.match(name)
            if m and int(m.group(1)) > step:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)


def _read_span(st: LocalStorage, stream: list[tuple[str, int]], lo: int, n: int):
    import numpy as np

    out = np.empty(n, dtype=np.uint8)
    pos = 0
    for name, size in stream:
        if lo + n <= pos:
            break
        a, b = max(lo, pos), min(lo + n, pos + size)
        if a < b:
            st.readinto(name, a - pos, memoryview(out[a - lo:b - lo]))
        pos += size
    return out


def _write_span(st: LocalStorage, stream: list[tuple[str, int]], w: list, data) -> None:
    mv = memoryview(data)
    while len(mv):
        name, size = stream[w[1]]
        if w[0] is None:
            w[0] = st.open_writer(name)
        take = min(len(mv), size - w[2])
        w[0].write(mv[:take])
        mv, w[2] = mv[take:], w[2] + take
        if w[2] == size:
            w[0].close()
            w[0], w[1], w[2] = None, w[1] + 1, 0
