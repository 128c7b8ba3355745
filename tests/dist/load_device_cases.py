"""Rank functions for shared loads onto the simulated asynchronous device (2 gloo ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.dist import Comm
from shardpoint.engine.load import ReadTuning, execute_reads
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.storage import storage_for
from shardpoint.testing import flip_byte
from tests.unit.device_copies import pageable_copies_into


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {f"big{i}": torch.randn(300, 256, generator=g) for i in range(6)}  # 300 KiB spans, read once and sent
    out.update({f"half{i}": torch.randn(200, 256, generator=g).to(torch.bfloat16) for i in range(3)})
    out.update({f"small{i}": torch.randint(0, 99, (7, 5 + i), generator=g) for i in range(8)})
    for r in range(2):  # what only rank r needs: read by it alone, small ones in one batch
        out[f"own{r}_big"] = torch.randn(257, 300, generator=g)
        out.update({f"own{r}_small{i}": torch.randn(3 + i, 9, generator=g).to(torch.float16) for i in range(3)})
    return out


def _targets(state: dict[str, torch.Tensor], rank: int) -> tuple[list[LoadTarget], list[torch.Tensor]]:
    targets, want = [], []
    for k, v in state.items():
        if k.startswith("own") and not k.startswith(f"own{rank}_"):
            continue
        if k.startswith("half"):  # a column block per rank, as tensor parallelism's Shard(1)
            c, n = 128 * rank, 128
            targets.append(LoadTarget(f"extra.{k}", torch.zeros(v.shape[0], n, dtype=v.dtype), tuple(v.shape), Box((0, c), (v.shape[0], n))))
            want.append(v[:, c : c + n])
        else:  # replicated: every rank needs it whole, one of them reads it
            dest = torch.full(v.shape[::-1], 7, dtype=v.dtype).t() if k.endswith("1") else torch.full(v.shape, 7, dtype=v.dtype)
            targets.append(LoadTarget(f"extra.{k}", dest, tuple(v.shape), Box.full(tuple(v.shape))))
            want.append(v)
    return targets, want


def shared_load_job(rank: int, world: int, root: str, window: int, corrupt: bool = False, block: int | None = None) -> dict:
    """Load replicated and column-sharded tensors with shared reads onto the simulated device; count pageable copies."""
    path = os.path.join(root, "ck")
    state = _state()
    if rank == 0:
        sp.save(path, {"extra": state}, process_group=sp.LOCAL, **({} if block is None else {"block_size": block}))
        if corrupt:  # a span one rank reads for both fails its checksum there
            chunk = sp.read_manifest(path).tensors["extra.big3"].chunks[0]
            flip_byte(os.path.join(path, chunk.file), chunk.offset + 1000)
    dist.barrier()
    targets, want = _targets(state, rank)
    storage = storage_for(path)
    sim = SimulatedDevice(delay=0.0005)
    try:
        with pageable_copies_into(sim, [t.dest for t in targets]) as count:
            stats = execute_reads(storage, sp.read_manifest(path), targets, storage.url, True, Comm.resolve(None),
                                  ReadTuning(share=True, window=window, device=sim))
    except sp.CorruptCheckpointError as e:
        return {"error": str(e), "pinned_after": sim.pinned_bytes}
    finally:
        sim.close()
    return {
        "exact": [torch.equal(t.dest, w) for t, w in zip(targets, want)],
        "pageable": count.n,
        "sim_pageable": sim.pageable_copies,
        "shared_spans": stats.shared_spans,
        "received": stats.bytes_received,
        "read": stats.bytes_read,
        "data": sum(sp.read_manifest(path).files.values()),
        "pinned_after": sim.pinned_bytes,
    }
