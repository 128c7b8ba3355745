"""TinyGPT under every parallel layout the tests cover, one training step, and its full state.

:func:`build` puts a :class:`~shardpoint.testing.gpt.TinyGPT` and AdamW under a
named layout on the current process group (DDP, FSDP1, FSDP2, HSDP, TP, 2-D,
pipeline stages); :func:`full_state` gathers every tensor unsharded, through
the framework's own means, as a reference to compare a load against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import Block, GPTConfig, TinyGPT, batch, loss_of

__all__ = ["LAYOUTS", "PP_LAYOUTS", "GPTStage", "stage_layers", "replica_ranks", "train_step", "build", "full_state"]


def train_step(model, opt, step: int, c: GPTConfig) -> float:
    """One AdamW step on the deterministic batch; returns the loss before the step."""
    if isinstance(_stage_of(model), GPTStage):
        return _pp_train_step(model, opt, step, c)
    x, y = batch(step, c)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


LAYOUTS = ("single", "ddp", "fsdp2", "hsdp", "tp", "2d", "fsdp1", "fsdp1_orig", "fsdp1_hybrid", "pp", "pp_ddp", "pp_fsdp2")
PP_LAYOUTS = ("pp", "pp_ddp", "pp_fsdp2")


# ---------------------------------------------------------------- pipeline stages
def stage_layers(layers: int, stage: int, stages: int) -> range:
    """The global layer indices of ``stage`` (contiguous, earlier stages get the extra ones)."""
    base, extra = divmod(layers, stages)
    lo = stage * base + min(stage, extra)
    return range(lo, lo + base + (1 if stage < extra else 0))


class GPTStage(nn.Module):
    """One pipeline stage of a TinyGPT, split by hand as torchtitan does.

    The stage keeps only its own blocks, in a ``ModuleDict`` keyed by the
    global layer index, so its names (``layers.3.attn.wq.weight``) are those
    of the whole model. The first stage owns the embeddings, the last the
    final norm and head. ``pp_ranks`` are the global ranks of this rank's
    pipeline (one per stage) and ``dp_ranks`` those of its stage's
    data-parallel group, which hold copies of the same layers.
    """

    def __init__(self, full: TinyGPT, stage: int, stages: int):
        super().__init__()
        c = full.config
        if c.tied and stages > 1:
            raise ValueError("tied embeddings across pipeline stages are not supported by GPTStage")
        self.config = c
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos = full.tok, full.pos
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in stage_layers(c.layers, stage, stages)})
        if self.last:
            self.norm, self.head = full.norm, full.head
        self.pp_ranks: list[int] = [0]
        self.dp_ranks: list[int] = [0]
        self.pp_group = None

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.layers.values():
            x = blk(x)
        return self.head(self.norm(x)) if self.last else x


def _stage_of(model):
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def replica_ranks(model) -> list[int] | None:
    """For ``sp.save(..., replicated_over=...)``: the ranks holding copies of a pipeline stage."""
    st = _stage_of(model)
    return list(st.dp_ranks) if isinstance(st, GPTStage) else None


def _pp_train_step(model, opt, step: int, c: GPTConfig) -> float:
    """Forward and backward through the stages with point-to-point sends (one micro-batch)."""
    import torch.distributed as dist

    st = _stage_of(model)
    x, y = batch(step, c)
    me = st.pp_ranks[st.stage]
    prev = st.pp_ranks[st.stage - 1] if not st.first else None
    nxt = st.pp_ranks[st.stage + 1] if not st.last else None
    if st.first:
        inp = x
    else:
        inp = torch.empty(x.shape[0], x.shape[1], c.dim)
        dist.recv(inp, prev)
        inp.requires_grad_(True)
    out = model(inp)
    if st.last:
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        value = loss.detach().clone()
    else:
        dist.send(out.detach().contiguous(), nxt)
        grad = torch.empty_like(out)
        dist.recv(grad, nxt)
        out.backward(grad)
        value = torch.zeros(())
    if not st.first:
        dist.send(inp.grad.contiguous(), prev)
    dist.broadcast(value, src=st.pp_ranks[-1], group=st.pp_group)
    assert me == dist.get_rank()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(value)


def _build_pp(layout: str, model: TinyGPT) -> nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    stages = world if layout == "pp" else 2
    if world % stages:
        raise ValueError(f"{layout} needs a world size divisible by {stages}")
    mesh = init_device_mesh("cpu", (stages, world // stages), mesh_dim_names=("pp", "dp"))
    grid = mesh.mesh.tolist()
    rank = dist.get_rank()
    stage = next(i for i, row in enumerate(grid) if rank in row)
    col = grid[stage].index(rank)
    st = GPTStage(model, stage, stages)
    st.pp_ranks = [row[col] for row in grid]
    st.dp_ranks = list(grid[stage])
    st.pp_group = mesh["pp"].get_group()
    if layout == "pp_ddp":
        return nn.parallel.DistributedDataParallel(st, process_group=mesh["dp"].get_group())
    if layout == "pp_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in st.layers.values():
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(st, mesh=mesh["dp"])
    return st


def build(layout: str, c: GPTConfig = GPTConfig(), seed: int = 0, lr: float = 1e-2):
    """A TinyGPT and AdamW under ``layout`` on the default process group.

    ``single`` needs no process group. ``hsdp`` and ``2d`` use a 2 x (world/2)
    mesh; ``tp`` uses all ranks as one tensor-parallel group. ``fsdp1`` and
    ``fsdp1_orig`` wrap each block and the root in FSDP1 with
    ``use_orig_params`` False and True; ``fsdp1_hybrid`` is FSDP1
    ``HYBRID_SHARD`` on a 2 x (world/2) mesh, with activation-checkpoint
    wrappers around the blocks. ``pp`` makes every rank a pipeline
    stage (:class:`GPTStage`); ``pp_ddp`` and ``pp_fsdp2`` make two stages,
    each data-parallel (DDP or FSDP2) over half of the ranks.
    """
    torch.manual_seed(seed)
    model = TinyGPT(c)
    if layout == "single":
        pass
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=layout == "fsdp1_orig",
            device_id=torch.device("cpu"),
        )
    elif layout == "fsdp1_hybrid":
        import torch.distributed as dist
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh, use_orig_params=True, device_id=torch.device("cpu"),
        )
    elif layout in PP_LAYOUTS:
        model = _build_pp(layout, model)
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if layout == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
            for blk in model.layers:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            for blk in model.layers:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif layout == "tp":
            mesh = init_device_mesh("cpu", (world,))
            _tp(model, mesh)
        elif layout == "2d":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            _tp(model, mesh["tp"])
            for blk in model.layers:
                fully_shard(blk, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        else:
            raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt


def _tp(model: TinyGPT, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    if model.config.vocab_pad:
        from torch.distributed.tensor import Replicate

        plan["tok"] = RowwiseParallel(input_layouts=Replicate())  # vocab-parallel embedding
    for i in range(len(model.layers)):
        for n in (("wqkv",) if model.config.fused else ("wq", "wk", "wv")):
            plan[f"layers.{i}.attn.{n}"] = ColwiseParallel()
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.w1"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _full(t):
    t = t.detach()
    # full_tensor() of a Replicate DTensor aliases the live local tensor: clone it.
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _fsdp1_full_state(model, opt) -> dict[str, torch.Tensor]:
    # FSDP1's own gather, independent of shardpoint: the reference for FSDP1 layouts.
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    ):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{name}.{k}"] = v.detach().clone()
    return out


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, unsharded, keyed by parameter name (collective).

    FSDP1 layouts use FSDP1's full state dict; pipeline stages gather every
    stage's tensors, so each rank gets the whole model's.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return _fsdp1_full_state(model, opt)
    if isinstance(_stage_of(model), GPTStage):
        import torch.distributed as dist

        local = _full_state_of(_stage_of(model), opt)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        out = {}
        for p in parts:
            out.update(p)
        return out
    return _full_state_of(model, opt)


def _full_state_of(model, opt) -> dict[str, torch.Tensor]:
    m = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {f"model.{k}": _full(v) for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"opt.{names[id(p)]}.{k}"] = _full(v)
    return out

