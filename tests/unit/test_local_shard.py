"""A distributed tensor's local shard, read one way wherever the library needs it."""

from __future__ import annotations

import torch

from shardpoint.adapters.tensors import local_shard


class _Sharded:
    """Stands in for a DTensor: its shard is an attribute, and to_local() must not be called."""

    def __init__(self, local):
        self._local_tensor = local

    def to_local(self):  # pragma: no cover - the attribute is read instead
        raise AssertionError("to_local() called although the shard is at hand")


class _OnlyToLocal:
    def __init__(self, local):
        self.local, self.grad_mode = local, None

    def to_local(self):
        self.grad_mode = torch.is_grad_enabled()
        return self.local


def test_local_shard_reads_a_dtensors_shard_asks_other_wrappers_and_passes_plain_tensors():
    plain, shard = torch.ones(3), torch.zeros(2)
    assert local_shard(plain) is plain
    assert local_shard(_Sharded(shard)) is shard
    wrapper = _OnlyToLocal(shard)
    assert local_shard(wrapper) is shard and wrapper.grad_mode is False  # asked without recording autograd
