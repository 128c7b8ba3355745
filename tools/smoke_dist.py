"""A 2-rank FSDP2 save and resharding loads, with an installed shardpoint (run by `make package-check`).

Run it from a folder that holds no ``shardpoint`` package, with the venv that
has the wheel installed: two gloo ranks train a small FSDP2 model one step
and save it with its optimizer; the same two ranks load it into a
tensor-parallel copy, and this process loads it whole into a plain one. Every
parameter and optimizer moment must come back bit for bit.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import shardpoint as sp
from shardpoint.runtime.torchcompat import enable_cpu_fsdp2

WORLD = 2


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW moments whole, whatever the layout (a collective when sharded)."""
    out = {k: whole(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{moment}"] = whole(opt.state[p][moment])
    return out


def rank_main(rank: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = build()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        sp.save(os.path.join(root, "ckpt"), {"model": model, "optimizer": opt})
        want = gathered(model, opt)

        tp = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        nn.init.zeros_(tp[0].weight)  # the load must overwrite what is there
        tp_opt = torch.optim.AdamW(tp.parameters(), lr=1e-2)
        sp.load(os.path.join(root, "ckpt"), {"model": tp, "optimizer": tp_opt})
        got = gathered(tp, tp_opt)
        for k in want:
            assert torch.equal(got[k], want[k]), f"rank {rank}: {k} differs after the FSDP2 -> TP load"
        if rank == 0:
            torch.save(want, os.path.join(root, "want.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    enable_cpu_fsdp2()  # torch 2.6 runs FSDP2 on CPU only with it; later releases need nothing
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(rank_main, args=(port, root), nprocs=WORLD, start_method="fork", join=True)
        want = torch.load(os.path.join(root, "want.pt"), weights_only=True)
        plain = build()
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sp.load(os.path.join(root, "ckpt"), {"model": plain, "optimizer": plain_opt})
        got = gathered(plain, plain_opt)
        assert sorted(got) == sorted(want) and len(want) == 12, sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k} differs after the 2 -> 1 rank load"
    print(f"2-rank FSDP2 save, loads into TP on 2 ranks and into 1 process: bit-exact (torch {torch.__version__})")


if __name__ == "__main__":
    main()
    sys.exit(0)
