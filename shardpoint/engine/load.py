"""The load engine's entry: plan the reads of every target, then fetch them locally or shared.

What to read is decided by the pure planners (:mod:`shardpoint.planning.reads`:
the byte spans each target needs, merged and ordered;
:mod:`shardpoint.planning.sharing`: which rank reads a span several ranks
need). This module binds the plan to the target tensors and runs it:

- locally (:mod:`.read_local`): reader threads prefetch under a byte budget,
  verify, and the loading thread copies into place (into an accelerator
  through bounce buffers, :mod:`.bounce`); ranks walk the files
  in staggered orders (:func:`~shardpoint.planning.reads.order_reads`); or
- shared, "read once" (:mod:`.read_shared`): each span needed by several
  ranks is read by one of them and sent to the others over the process group
  (spans bound for an accelerator land in bounce rings there too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xxhash

from ..device import Device, device_for, devices_of
from ..items import LoadTarget, dtype_name
from ..dist import Comm
from ..format.manifest import Manifest
from ..planning.reads import DEFAULT_COALESCE, ReadTarget, order_reads, plan_chunk_reads
from ..storage.base import Storage
from .bounce import BounceRing
from .read_local import LoadStats, ReadJob, execute_local
from .read_shared import exchange_only, execute_shared

__all__ = ["LoadStats", "ReadTuning", "read_targets", "execute_reads", "DEFAULT_WINDOW", "BOUNCE_THREADS", "BOUNCE_WINDOW"]

DEFAULT_WINDOW = 256 << 20  # bytes read ahead of the copies

# Reader threads and read-ahead when spans land on an accelerator: the copy engine outruns one
# reader many times over, so enough reads of whole chunks run at once to keep it busy.
BOUNCE_THREADS = max(2, min(8, os.cpu_count() or 2))
BOUNCE_WINDOW = 512 << 20


def read_targets(targets: Sequence[LoadTarget]) -> list[ReadTarget]:
    """The geometry planning needs of each target (name, dtype name, shape, place), in the same order."""
    names: dict[torch.dtype, str] = {}
    out = []
    for t in targets:
        dt = t.dest.dtype
        name = names.get(dt)
        if name is None:
            name = names[dt] = dtype_name(dt)
        out.append(ReadTarget(t.fqn, name, tuple(t.shape), t.box, t.flat))
    return out


@dataclass(frozen=True, kw_only=True)
class ReadTuning:
    """How :func:`execute_reads` reads: sharing, read-ahead, threads, timings and the target device.

    ``share`` is True, False or ``"auto"``; ``window`` bounds the bytes read
    ahead of the copies; ``recorder`` receives the phase timings; ``device``
    overrides the device the targets are found on.

    Example::

        execute_reads(storage, manifest, targets, storage.url, tuning=ReadTuning(threads=1))
    """

    share: bool | str = "auto"
    window: int = DEFAULT_WINDOW
    threads: int = 2
    recorder: Any = None
    device: Device | None = None


def execute_reads(
    storage: Storage,
    manifest: Manifest,
    targets: Sequence[LoadTarget],
    where: str,
    verify: bool = True,
    comm: Comm | None = None,
    tuning: ReadTuning | None = None,
) -> LoadStats:
    """Fill every target. ``share`` reads spans needed by several ranks only once.

    Targets on an accelerator (or on ``device``, when given) are filled
    through bounce buffers, copied in the background; the call
    returns once every copy is complete.

    ``share="auto"`` shares unless every rank is on one host and the storage
    is page-cached (``Storage.page_cached``). With sharing and a process
    group, this is a collective: every rank of ``comm`` must call it, even
    with no targets.
    """
    tuning = ReadTuning() if tuning is None else tuning
    share, device = tuning.share, tuning.device
    if share not in (True, False, "auto"):
        raise ValueError(f"share_reads must be True, False or 'auto', got {share!r}")
    auto = share == "auto"
    if auto and not storage.page_cached:
        share, auto = True, False
    if device is None:
        where_devs = devices_of(t.dest for t in targets)  # every device: each target's copy goes through its own
        device = device_for(where_devs) if where_devs else None
    # Backends with high per-request latency (object stores) ask for more reads in flight.
    threads = max(tuning.threads, int(storage.read_threads))
    job = ReadJob(storage, targets, where, manifest.block_size, verify, LoadStats(), tuning.window, threads, tuning.recorder)
    with _gc_paused():
        return _execute_reads(job, manifest, comm, share, auto, device)


@contextlib.contextmanager
def _gc_paused():
    """No automatic garbage collection while the reads run.

    The read phase allocates tens of thousands of short-lived objects; each
    young-generation collection promoted the live ones, and every few loads
    that triggered a full collection of the whole process (0.15 to 0.37 s
    for a training process holding about 290k tracked objects, longer than
    the resharding load itself). Paused, the objects die by reference
    counting before the next collection looks at them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _one_host(comm: Comm) -> bool:
    """Whether every rank of ``comm`` runs on this host (a collective: one all-gather)."""
    hosts = comm.all_gather_rows(torch.tensor([[_host_id()]], dtype=torch.int64))
    return len({int(h[0, 0]) for h in hosts}) == 1


def _host_id() -> int:
    return xxhash.xxh3_64_intdigest(socket.gethostname().encode()) >> 1


def _plan(manifest: Manifest, targets: Sequence[LoadTarget], where: str, verify: bool, stats: LoadStats, coalesce: int):
    reads = plan_chunk_reads(manifest, read_targets(targets), where, verify, coalesce)
    stats.bytes_needed += sum(r.needed for r in reads)
    return reads


def _bounce_window(window: int) -> int:
    """The read-ahead of spans landing on an accelerator: at least :data:`BOUNCE_WINDOW` unless set."""
    return max(window, BOUNCE_WINDOW) if window == DEFAULT_WINDOW else window


def _execute_reads(job: ReadJob, manifest: Manifest, comm, share, auto: bool, device) -> LoadStats:
    storage, targets, where, verify, stats, recorder = job.storage, job.targets, job.where, job.verify, job.stats, job.rec
    t_plan = time.monotonic()
    # Object stores also ask for wider coalescing of nearby runs.
    coalesce = DEFAULT_COALESCE if storage.coalesce_bytes is None else int(storage.coalesce_bytes)
    group = comm is not None and comm.active and comm.world > 1
    # With auto, every rank on one host means page-cached storage: re-reads come from memory.
    share = share and group and not (auto and _one_host(comm))
    if share:
        try:
            reads = _plan(manifest, targets, where, verify, stats, coalesce)
            if recorder is not None:
                recorder.add("plan", t_plan, time.monotonic())
        except Exception:
            # Still take part in the exchange (with nothing), so no peer waits for this rank.
            exchange_only(comm)
            raise
        if device is not None:  # spans land in bounce rings: as many reads in flight as the local path
            job = dataclasses.replace(job, window=_bounce_window(job.window), threads=max(job.threads, BOUNCE_THREADS))
        execute_shared(job, reads, comm, dict(manifest.files), manifest.world_size, device)
    else:
        reads = _plan(manifest, targets, where, verify, stats, coalesce)
        if group:
            reads = order_reads(reads, comm.rank, comm.world, dict(manifest.files), manifest.world_size)
        if recorder is not None:
            recorder.add("plan", t_plan, time.monotonic())
        if device is None:
            execute_local(job, reads)
            return stats
        window = _bounce_window(job.window)
        bounce = BounceRing(device, window)
        try:
            execute_local(dataclasses.replace(job, window=window, threads=max(job.threads, BOUNCE_THREADS)), reads, bounce)
        finally:
            bounce.finish()
    return stats
