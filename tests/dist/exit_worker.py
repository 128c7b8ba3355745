"""One rank of the clean-exit check: save in every way, then leave the interpreter normally.

Run as ``python -m tests.dist.exit_worker ROOT DESTROY`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun would.
Unlike the forked ranks of :func:`shardpoint.testing.launch`, which leave
with ``os._exit``, this process runs interpreter finalisation, where a gloo
thread or private group left behind aborts the process.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, train_step

__all__ = ["main"]


def main(root: str, destroy: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    c = GPTConfig()
    model, opt = build("fsdp2", c, seed=0)
    train_step(model, opt, 0, c)
    state = {"model": model, "optimizer": opt, "extra": {"step": 1}}
    sp.save(os.path.join(root, "sync"), state)
    sp.async_save(os.path.join(root, "async"), state, mode="lazy").wait()  # the default saver, never closed
    saver = sp.AsyncSaver()
    saver.save(os.path.join(root, "closed"), state).wait()
    group = saver._coordination(sp.dist.Comm.resolve(None)).group  # the cached private group of the default group
    saver.close()  # destroys its private group: using it now fails
    try:
        dist.get_process_group_ranks(group)
        print("private group still alive", flush=True)
    except (KeyError, ValueError, RuntimeError):
        print("private group destroyed", flush=True)
    del group
    mgr = sp.CheckpointManager(os.path.join(root, "run"), interval=1, mode="eager", timeout=120)
    mgr.maybe_save(1, state)
    mgr.wait()  # left open: its private group and threads must still end cleanly
    m2, o2 = build("fsdp2", c, seed=1)
    sp.load(os.path.join(root, "sync"), {"model": m2, "optimizer": o2, "extra": {}}, share_reads=True)
    if destroy:
        dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '?'} finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
