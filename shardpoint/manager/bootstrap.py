"""Starting the default process group so that it survives torchrun's elastic restarts."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(backend: str = "gloo", timeout: float | None = None, **kwargs) -> None:
    """``init_process_group`` from torchrun's environment, safe across elastic restarts.

    torchrun's agent keeps one TCPStore for the whole job and hands it to
    every restart attempt without a per-attempt namespace. A process group
    created after a restart (``dist.new_group``, DeviceMesh sub-groups, the
    manager's and the async saver's private groups) can then read the address
    of a dead worker from the previous attempt and fail with "Gloo
    connectFullMesh failed ... Connection refused". This wraps the store in a
    prefix per attempt (``TORCHELASTIC_RESTART_COUNT``). Outside torchrun it
    is a plain ``init_process_group(backend)``.

    Example::

        from shardpoint.manager import init_distributed
        init_distributed("gloo")          # instead of dist.init_process_group("gloo")
    """
    kw = dict(kwargs)
    if timeout is not None:
        kw["timeout"] = timedelta(seconds=timeout)
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env:
        dist.init_process_group(backend, **kw)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
        is_master=(not agent_store and rank == 0), multi_tenant=not agent_store,
        timeout=kw.get("timeout", timedelta(minutes=30)),
    )
    prefix = f"shardpoint/attempt_{env['TORCHELASTIC_RESTART_COUNT']}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, **kw)
