"""Replica digests: a few integers per tensor, equal for equal bit patterns, computed where the data lives.

Used by the replica check at save (:mod:`shardpoint.saving.replicas`). Bit
patterns are compared, so ``-0.0`` and ``0.0`` differ and NaNs are compared
exactly:

- a CPU tensor of at most :data:`HOST_FULL_BYTES`: ``xxh3_64`` of all its
  bytes; a larger one: ``xxh3_64`` of a strided sample of :data:`SAMPLES`
  elements, one in every ``numel / SAMPLES``-element stretch, the first and
  last included. ``SHARDPOINT_REPLICA_CHECK=full`` hashes every byte;
- a tensor on an accelerator, with torch ops on its own device (nothing but
  the digest is copied to the host): the first element's bit pattern, a
  position-weighted sum of the same strided sample, and the sum of all bit
  patterns viewed as integers of the same width, added up as 64-bit
  integers in pieces of :data:`SUM_PIECE` elements (wrap-around addition
  is exact in any order, and no temporary is larger than a piece).
  :func:`digest_queued` queues this work after the caller's (where the
  device queues its copies) and reads the result only when asked, at the
  commit: the call neither waits for the device nor passes over its
  memory on the training thread's queue.

The first field of a digest says which way it was computed (:data:`HOST`
or :data:`DEVICE`).

Example::

    digest_all([w1, w2])  # [(kind, a, b, c), (kind, a, b, c)]
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from ..device import device_for

__all__ = ["SAMPLES", "HOST_FULL_BYTES", "HOST", "DEVICE", "SUM_PIECE", "check_mode", "digest_tensor", "digest_all", "digest_queued", "QueuedDigests"]

SAMPLES = 1024
SUM_PIECE = 1 << 22  # elements summed at once: a 32 MiB int64 temporary at most
HOST_FULL_BYTES = 1 << 16
HOST, DEVICE = 0, 1  # the first field of a digest: how it was computed

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a view where torch allows one)."""
    dt = _INT.get(t.element_size())
    if dt is None:  # complex128: 16-byte elements as two 8-byte halves
        return torch.view_as_real(t.resolve_conj()).view(torch.int64)
    if t.dtype == dt:
        return t
    try:
        return t.view(dt)
    except RuntimeError:  # a dtype torch will not reinterpret in place (e.g. a conjugate view)
        return t.resolve_conj().resolve_neg().contiguous().view(dt)


def check_mode() -> str:
    """How much of each CPU tensor the replica check hashes: ``SHARDPOINT_REPLICA_CHECK`` (``sample``, ``full``, ``off``).

    Example::

        check_mode()  # 'sample' unless the environment says otherwise
    """
    mode = os.environ.get("SHARDPOINT_REPLICA_CHECK", "sample").strip().lower() or "sample"
    if mode not in ("sample", "full", "off"):
        raise ValueError(f"SHARDPOINT_REPLICA_CHECK must be 'sample', 'full' or 'off', got {mode!r}")
    return mode


_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.int64}


def _np_sample(n: int) -> np.ndarray:
    """One index in each of ``min(n, SAMPLES)`` equal stretches of ``[0, n)``, the last element included.

    Made each time: a few microseconds, less than a lookup's upkeep is worth.
    """
    k = min(n, SAMPLES)
    idx = np.arange(k, dtype=np.int64) * n // k
    idx[-1] = n - 1
    return idx


def _sample_index(n: int, device: torch.device, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One index in each of ``min(n, SAMPLES)`` equal stretches of ``[0, n)`` (the last element included), and odd weights."""
    key = (n, device)
    if key not in cache:
        if device.type == "cpu":
            idx = torch.from_numpy(_np_sample(n)).clone()  # the host digests sample the same elements
        else:
            # Made on the device: a copy from the host's memory would wait for the device's queue.
            k = min(n, SAMPLES)
            idx = torch.arange(k, dtype=torch.int64, device=device) * n // k
            idx[-1] = n - 1
        cache[key] = (idx, idx * 2 + 1)  # odd weights: a swap of two sampled values changes the sum
    return cache[key]


def _raw_digest(t: torch.Tensor, full: bool) -> tuple[int, ...] | None:
    """:func:`_host_digest` of a dense CPU tensor, read straight from its memory; ``None`` where that does not apply.

    No torch op per tensor (each costs microseconds, and a save digests
    hundreds of tensors): a contiguous tensor's memory is its row-major bytes.
    """
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    size = t.element_size()
    n = t.numel() * (2 if size == 16 else 1)  # complex128: counted as int64 halves, as _bits views it
    nbytes = t.numel() * size
    if nbytes == 0:
        return (HOST, xxhash.xxh3_64_intdigest(b""), 0, 0)
    if t.untyped_storage().nbytes() < t.storage_offset() * size + nbytes:  # a freed or shrunk storage: torch decides
        return None
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    if full or nbytes <= HOST_FULL_BYTES:
        return (HOST, xxhash.xxh3_64_intdigest(buf), n, 0)
    sample = np.frombuffer(buf, dtype=_NP[size]).take(_np_sample(n))
    return (HOST, xxhash.xxh3_64_intdigest(memoryview(sample).cast("B")), n, 0)


def _host_digest(t: torch.Tensor, full: bool, cache: dict) -> tuple[int, ...]:
    """``xxh3_64`` of a CPU tensor's bytes in row-major order, or of a strided sample of its elements."""
    bits = _bits(t)
    n = bits.numel()
    sample = not full and n * bits.element_size() > HOST_FULL_BYTES
    if not bits.is_contiguous():
        bits = torch.take(bits, _sample_index(n, bits.device, cache)[0]) if sample else bits.contiguous()
        sample = False
    arr = bits.reshape(-1).numpy()
    if sample:
        arr = arr[_np_sample(n)]
    return (HOST, xxhash.xxh3_64_intdigest(memoryview(arr).cast("B")) if arr.size else xxhash.xxh3_64_intdigest(b""), n, 0)


def _device_parts(t: torch.Tensor, cache: dict) -> tuple[torch.Tensor, ...]:
    """The three device digest scalars of ``t`` as 0-d int64 tensors on ``t``'s device."""
    bits = _bits(t)
    n = bits.numel()
    if n == 0:
        z = torch.zeros((), dtype=torch.int64, device=t.device)
        return z, z, z
    idx, weights = _sample_index(n, bits.device, cache)
    sample = torch.take(bits, idx).to(torch.int64)
    return sample[0], (sample * weights).sum(), _sum64(bits)


def _sum64(bits: torch.Tensor) -> torch.Tensor:
    """The sum of all elements as int64 (wrapping), converted a piece at a time, not the whole tensor at once."""
    if bits.numel() <= SUM_PIECE:
        return bits.sum(dtype=torch.int64)
    if bits.is_contiguous():
        parts = bits.reshape(-1).split(SUM_PIECE)
    else:  # rows at a time: a view's pieces need no copy of the whole
        rows = max(1, SUM_PIECE // max(1, bits[0].numel()))
        parts = bits.split(rows)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for part in parts:
        total += part.sum(dtype=torch.int64)
    return total


def digest_tensor(t: torch.Tensor, host: bool = True) -> tuple[int, ...]:
    """The replica digest of one tensor; see the module documentation.

    ``host=False`` computes a CPU tensor's digest the way an accelerator's
    is computed (for tests of that path).

    Example::

        digest_tensor(torch.ones(4))  # equal for equal bit patterns
    """
    return digest_all([t], host)[0]


def _host_pass(
    tensors: Sequence[torch.Tensor], host: bool, cache: dict,
) -> tuple[list[tuple[int, ...]], dict[torch.device, list[int]]]:
    """The digests of CPU tensors (hashed now, others left as placeholders), and the others' positions by device."""
    out: list[tuple[int, ...]] = [(HOST, 0, 0, 0)] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    full = check_mode() == "full"
    for i, t in enumerate(tensors):
        if host and t.is_cpu:
            d = _raw_digest(t, full)
            out[i] = d if d is not None else _host_digest(t.detach(), full, cache)
        else:
            by_dev.setdefault(t.device, []).append(i)
    return out, by_dev


def digest_all(tensors: Sequence[torch.Tensor], host: bool = True) -> list[tuple[int, ...]]:
    """Digests of many tensors: CPU ones hashed in place, others on their devices with one host copy per device.

    Example::

        digest_all([w1, w2])  # [(kind, a, b, c), ...]
    """
    cache: dict = {}
    out, by_dev = _host_pass(tensors, host, cache)
    for idx in by_dev.values():
        table = torch.stack([torch.stack(_device_parts(tensors[i].detach(), cache)) for i in idx]).cpu().tolist()
        for i, row in zip(idx, table):
            out[i] = (DEVICE, int(row[0]), int(row[1]), int(row[2]))
    return out


class QueuedDigests:
    """Digests being computed: read with :meth:`result` (waits for the device's work only then).

    Example::

        pending = digest_queued(tensors)
        ...                      # the save goes on; the device computes
        pending.result()         # [(kind, a, b, c), ...]
    """

    def __init__(self, out: list[tuple[int, ...]], queued: list[tuple[list[int], torch.Tensor, Any]]):
        self._out = out
        self._queued = queued  # (positions, host table, completion event), one per device

    def result(self) -> list[tuple[int, ...]]:
        """The digests, in the order given; the first call waits for what the devices still compute."""
        for idx, table, event in self._queued:
            event.synchronize()
            for i, row in zip(idx, table.tolist()):
                self._out[i] = (DEVICE, int(row[0]), int(row[1]), int(row[2]))
        self._queued = []
        return self._out


def digest_queued(tensors: Sequence[torch.Tensor], host: bool = True) -> QueuedDigests:
    """:func:`digest_all`, with each device's part queued after the caller's work and read later.

    CPU tensors are hashed now (as by :func:`digest_all`). The digests of
    tensors on an accelerator are computed where its device object queues
    copies, after everything the calling thread queued so far, and copied
    to host memory without waiting; the caller's later work is ordered after
    them on the device (so the next step cannot change a tensor before its
    digest read it), and :meth:`QueuedDigests.result` waits.

    Example::

        pending = digest_queued([w_gpu, b_gpu]); ...; pending.result()
    """
    cache: dict = {}
    out, by_dev = _host_pass(tensors, host, cache)
    queued = []
    for where, idx in by_dev.items():
        dev = device_for(where)
        data = [tensors[i].detach() for i in idx]

        def compute(data=data) -> torch.Tensor:
            return torch.stack([torch.stack(_device_parts(t, cache)) for t in data])

        table, event = dev.queue_to_host(compute, dev.snapshot_point())
        dev.order_after(event)  # later work of the caller (the next step) waits on the device, the host goes on
        queued.append((idx, table, event))
    return QueuedDigests(out, queued)
