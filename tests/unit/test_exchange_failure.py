"""The shared-read exchange after a transport failure: no send is left in flight when the load returns (one process, a stand-in peer)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.engine.read_local import LoadStats, ReadJob
from shardpoint.engine.load import read_targets
from shardpoint.engine.read_shared import execute_shared
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.planning.reads import plan_chunk_reads
from shardpoint.planning.sharing import owner_replies
from shardpoint.storage import storage_for


class _Handle:
    def __init__(self, log: list, fail: bool):
        self.log, self.fail, self.done = log, fail, False

    def wait(self) -> None:
        self.log.append(self)
        if self.fail:
            self.fail = False
            raise RuntimeError("Connection closed by peer")
        self.done = True

    def is_completed(self) -> bool:
        return self.done


class _PeerOfRankZero:
    """Rank 0 of 2, with a peer that needs the same spans; the peer's data never arrives (its mark says it failed).

    The first send's completion fails, as a closed connection does.
    """

    rank, world, active = 0, 2, True

    def __init__(self):
        self.sends: list[_Handle] = []
        self.waited: list[_Handle] = []
        self._first: list[np.ndarray] = []

    def all_to_all_rows(self, parts, k):
        parts = [p.numpy() for p in parts]
        if not self._first:  # the peer sends the owner of each span the same rows as this rank
            self._first = parts
            return [torch.from_numpy(parts[0]), torch.from_numpy(parts[0].copy())]
        peer = owner_replies([self._first[1], self._first[1]], 2, 1)  # what the peer, as an owner, answers
        return [torch.from_numpy(parts[0]), torch.from_numpy(peer[0])]

    def isend(self, tensor, dst, tag=0):
        self.sends.append(_Handle(self.waited, fail=not self.sends))
        return self.sends[-1]

    def irecv(self, tensor, src, tag=0):
        return _Handle([], fail=False)  # the buffer keeps its zero mark: the peer could not read


def test_a_transport_failure_ends_the_walk_only_after_every_send_is_waited(tmp_path):
    path = os.path.join(tmp_path, "ck")
    state = {f"w{i}": torch.randn(64, 256) for i in range(12)}  # 64 KiB spans
    sp.save(path, {"m": state}, process_group=sp.LOCAL)
    manifest = sp.read_manifest(path)
    targets = [LoadTarget(f"m.{k}", torch.zeros_like(v), tuple(v.shape), Box.full(tuple(v.shape))) for k, v in state.items()]
    storage = storage_for(path)
    reads = plan_chunk_reads(manifest, read_targets(targets), storage.url, True, 0)
    comm = _PeerOfRankZero()
    job = ReadJob(storage, targets, storage.url, manifest.block_size, True, LoadStats(), 256 << 10, 2)  # 128 KiB in flight
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        execute_shared(job, reads, comm, dict(manifest.files), manifest.world_size)
    assert len(comm.sends) >= 3
    # Before: the sends posted after the failing one were still in flight when the load returned.
    assert all(h in comm.waited for h in comm.sends)
