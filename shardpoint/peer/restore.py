"""Loading one complete memory step from the live hosts' memory folders.

:func:`restore_step` runs the plan of :func:`~shardpoint.peer.plan.choose_memory_step`:
each file is read from this host's folder when it holds a copy, else from a
peer host through that host's :class:`~shardpoint.peer.serve.PeerServer`.
The load itself is :func:`shardpoint.load` over a
:class:`~shardpoint.peer.routed.RoutedStorage`, so it reshards to the current
layout and verifies every byte it reads; a chunk that fails its checksum is
read again from the file's next copy (see :meth:`RoutedStorage.alternatives`).
The report times each phase, so that a slow restore can be taken apart.

Example::

    rep = restore_step(choice, listings, state, comm, own_dir, "h0")
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, MutableMapping, Sequence

from ..api import load as _sp_load
from ..dist import Comm
from ..errors import CorruptCheckpointError, FormatError, IncompleteCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.local import LocalStorage
from .plan import HostListing, MemoryChoice
from .routed import RoutedStorage
from .serve import PeerServer, RemoteFolder

__all__ = ["RestoreReport", "folder_name", "restore_step", "server_rank"]

log = logging.getLogger("shardpoint")

# Errors after which the whole load is tried again from other copies (a chunk's own
# fallback already failed, or an index file was bad).
RETRY = (CorruptCheckpointError, IncompleteCheckpointError, FormatError, FileNotFoundError)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore loaded: the step, its source and timings.

    ``source`` is the job's: ``"memory"`` (every rank read only its own
    host's memory), ``"peer"`` (some bytes came from other hosts' memory)
    or ``"storage"`` (the persistent checkpoint); ``rank_source`` is this rank's
    alone. ``bytes_from`` counts the bytes this rank read per host (a chunk
    read again from another copy counts on both). ``seconds`` maps phases
    to seconds on this rank: ``plan`` (announcements and the plan),
    ``manifest``, ``serve`` (starting the servers), ``load`` and, within it,
    the load's own phases as ``load.<phase>`` (``prepare``, ``read``,
    ``verify``, ``copy``, ``wait``, ``landing``), ``close`` (stopping the
    servers), ``served`` (this rank's server thread busy answering peers)
    and ``total``. ``attempts`` counts whole loads (more than one only when
    a chunk had no good copy left, or an index file was bad).
    """

    step: int
    source: str
    seconds: Mapping[str, float] = field(default_factory=dict)
    bytes_from: Mapping[str, int] = field(default_factory=dict)
    attempts: int = 1
    rank_source: str = ""


def folder_name(step: int) -> str:
    """The memory folder of ``step`` (``step_00000012``), alike on every host."""
    return f"step_{step:08d}"


def server_rank(ranks: Sequence[int], name: str, writer: int | None = None) -> int:
    """Which of a host's ``ranks`` serves file ``name`` to other hosts.

    A file written by rank ``writer`` goes to that rank's place among the
    host's ranks (modulo their number), so the data files of a lost host's
    ranks spread evenly over the serving host's ranks; other files by a hash
    of the name.
    """
    if writer is not None:
        return ranks[writer % len(ranks)]
    return ranks[zlib.crc32(name.encode()) % len(ranks)]


def restore_step(ch: MemoryChoice, gathered: Sequence[HostListing], state: MutableMapping[str, Any], comm: Comm,
                 own_dir: str, host: str, load_kwargs: Mapping[str, Any], t0: float, t_plan: float) -> RestoreReport | None:
    """Load ``ch`` into ``state``: own host's files from ``own_dir``, peers' through their servers.

    ``None`` when no copy of some file loads (the caller tries an older step). Collective.
    """
    secs: dict[str, float] = {"plan": t_plan}
    name = folder_name(ch.step)
    ranks_of: dict[str, list[int]] = {}
    for r, lst in enumerate(gathered):
        ranks_of.setdefault(lst.host, []).append(r)
    tm = time.monotonic()
    own = LocalStorage(os.path.join(own_dir, name))
    msrc = ranks_of[ch.manifest_host][0]
    mbytes = comm.broadcast(own.get(MANIFEST_NAME) if comm.rank == msrc else None, src=msrc)
    man = Manifest.from_json(mbytes, f"peer-memory:{name}")
    if man.save_id != ch.save_id:
        raise CorruptCheckpointError(f"peer-memory:{name}: the manifest changed during the restore")
    ts = time.monotonic()
    secs["manifest"] = ts - tm
    group = comm.group if comm.active else None
    server = PeerServer(comm, own, sorted(ch.sources)) if comm.active and comm.world > 1 else None
    secs["serve"] = time.monotonic() - ts
    writer = {f: i for i, rf in enumerate(man.ranks) for f in (rf.data, rf.index)}
    try:
        def src(h: str, f: str):
            if h == host:
                return own
            assert server is not None
            return RemoteFolder(server, server_rank(ranks_of[h], f, writer.get(f)), man.files, f"peer-memory:{h}/{name}")

        sources = {f: [(h, src(h, f)) for h in hs] for f, hs in ch.sources.items()}
        routed = RoutedStorage(f"peer-memory:{name}", mbytes, sources)
        attempts = 0
        kwargs = {k: v for k, v in load_kwargs.items() if k != "return_result"}
        while True:
            attempts += 1
            routed.bytes_from.clear()  # the source reported is the one of the attempt that loaded
            tl = time.monotonic()
            try:
                res = _sp_load(routed, state, process_group=group, return_result=True, **kwargs)
            except RETRY as e:
                # The same typed error reaches every rank: each moves the file it names (else every
                # file) on to its next copy, and all retry together.
                mine = routed.demote_named(str(e)) or routed.rotate_all()
                moved = comm.all_gather(mine) if comm.active else [mine]
                log.warning("rank %s: memory copy of %s failed (%s); %s", comm.rank, name, e,
                            "trying other hosts' copies" if any(moved) else "trying an older step")
                if any(moved):
                    continue
                return None
            secs["load"] = time.monotonic() - tl
            for k, v in (res.timings or {}).items():
                secs[f"load.{k}"] = v
            mine = "memory" if set(routed.bytes_from) <= {host} else "peer"
            kinds = comm.all_gather(mine) if comm.active else [mine]
            job = "peer" if "peer" in kinds else "memory"
            bytes_from = dict(routed.bytes_from)
            break
    finally:
        if server is not None:
            tc = time.monotonic()
            server.close()
            secs["close"] = time.monotonic() - tc
            secs["served"] = server.busy
    secs["total"] = time.monotonic() - t0
    return RestoreReport(ch.step, job, secs, bytes_from, attempts, mine)
