"""Helpers for tests, examples and benchmarks: a tiny GPT, layouts, a rank launcher.

``TinyGPT`` is a small but real transformer (embedding, attention, MLP, layer
norm, optional tied head). :func:`build` puts it under a named layout on the
current process group. :func:`launch` runs ``module:function`` on ``world``
ranks as real processes on gloo, bound to 127.0.0.1; a fresh launcher process
forks the ranks, which is many times cheaper than spawning each one.

Example::

    results = launch(4, "tests.dist.cases:save_job", {"root": "/tmp/x"})
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "GPTStage",
    "LAYOUTS",
    "PP_LAYOUTS",
    "replica_ranks",
    "build",
    "batch",
    "train_step",
    "full_state",
    "launch",
    "LaunchError",
    "flip_byte",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    tied: bool = False
    hidden: int = 0  # MLP width; 0 means 4 * dim
    kv_heads: int = 0  # grouped-query attention; 0 means heads (plain multi-head)
    fused: bool = False  # one wqkv projection, group-interleaved (Megatron style)
    vocab_pad: int = 0  # embedding rows padded to this size (0: none)

    @property
    def mlp(self) -> int:
        return self.hidden or 4 * self.dim

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def emb_rows(self) -> int:
        return max(self.vocab, self.vocab_pad)

    def qkv_rule(self):
        """The layout rule that maps ``wqkv`` onto ``wq``, ``wk`` and ``wv``."""
        from .layouts import Fused

        hd, g = self.dim // self.heads, self.heads // self.kv
        return Fused("*.attn.wqkv.weight", dim=0, groups=self.kv, parts=[("wq", g * hd), ("wk", hd), ("wv", hd)])


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.head_dim = hd = c.dim // c.heads
        self.group = c.heads // c.kv
        if c.fused:
            self.wqkv = nn.Linear(c.dim, c.kv * (self.group + 2) * hd, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.heads * hd, bias=False)
            self.wk = nn.Linear(c.dim, c.kv * hd, bias=False)
            self.wv = nn.Linear(c.dim, c.kv * hd, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        hd, g = self.head_dim, self.group
        # Head counts come from the local width, so column-wise TP shards work unchanged.
        if hasattr(self, "wqkv"):
            y = self.wqkv(x).view(b, t, -1, g + 2, hd)
            q = y[:, :, :, :g].reshape(b, t, -1, hd).transpose(1, 2)
            k = y[:, :, :, g].transpose(1, 2)
            v = y[:, :, :, g + 1].transpose(1, 2)
        else:
            q = self.wq(x).view(b, t, -1, hd).transpose(1, 2)
            k = self.wk(x).view(b, t, -1, hd).transpose(1, 2)
            v = self.wv(x).view(b, t, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.mlp)
        self.w2 = nn.Linear(c.mlp, c.dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT. Deterministic for a given seed, whatever the process."""

    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.emb_rows, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.layers:
            x = blk(x)
        return self.head(self.norm(x))


def batch(step: int, c: GPTConfig, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, c.vocab, (n, c.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


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


# ---------------------------------------------------------------- launcher
class LaunchError(RuntimeError):
    """A launched rank failed; the message carries every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, target: str, args: dict, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import faulthandler

    # A crash (SIGSEGV, SIGBUS) leaves every thread's stack in the launch's folder, for the error.
    crash = open(os.path.join(outdir, f"rank{rank}.crash"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(crash, all_threads=True)
    hang = float(os.environ.get("SHARDPOINT_HANG_DUMP_S", "0"))
    if hang > 0:  # print every thread's stack if this rank is still running then
        faulthandler.dump_traceback_later(hang, exit=True)
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mod, fn = target.split(":")
        value = getattr(importlib.import_module(mod), fn)(rank, world, **args)
        result = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _launcher_main(argv: list[str]) -> None:
    target, world, args_file, outdir = argv[0], int(argv[1]), argv[2], argv[3]
    with open(args_file) as f:
        args = json.load(f)
    import torch.multiprocessing as mp

    # Import once here, not in every forked rank: the first optimizer imports torch._dynamo,
    # which takes seconds per process when all ranks do it at once on a small machine.
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    port = _free_port()
    mp.start_processes(_rank_entry, args=(world, port, target, args, outdir), nprocs=world, start_method="fork", join=True)


def flip_byte(path: str, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at ``offset`` of the file ``path`` with ``mask``: the smallest corruption a checksum must catch.

    Example::

        chunk = sp.read_manifest(ck).tensors["w"].chunks[0]
        flip_byte(os.path.join(ck, chunk.file), chunk.offset + 7)
    """
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def launch(world: int, target: str, args: dict | None = None, timeout: float = 300) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world`` gloo ranks; return each rank's value.

    The function is called as ``fn(rank, world, **args)`` after the process
    group is up, and must return JSON-serialisable data.
    """
    with tempfile.TemporaryDirectory() as d:
        args_file = os.path.join(d, "args.json")
        with open(args_file, "w") as f:
            json.dump(args or {}, f)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("SHARDPOINT_HANG_DUMP_S", str(max(1.0, timeout - 15)))
        cwd = os.getcwd()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "shardpoint.testing", target, str(world), args_file, d],
                env=env, capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise LaunchError(f"{target} on {world} ranks timed out after {timeout}s\n{err[-6000:]}") from None
        results, failures = [], []
        for r in range(world):
            p = os.path.join(d, f"rank{r}.json")
            if not os.path.exists(p):
                crash = os.path.join(d, f"rank{r}.crash")
                dump = open(crash).read()[-4000:] if os.path.exists(crash) else ""
                failures.append(f"rank {r}: no result (crashed?)" + (f"\n{dump}" if dump.strip() else ""))
                results.append(None)
                continue
            with open(p) as f:
                res = json.load(f)
            if res["ok"]:
                results.append(res["value"])
            else:
                failures.append(f"rank {r}:\n{res['error']}")
                results.append(None)
        if failures:
            raise LaunchError(
                f"{target} on {world} ranks failed (exit {proc.returncode}):\n" + "\n".join(failures)
                + f"\n--- stderr tail ---\n{proc.stderr[-3000:]}"
            )
        return results


if __name__ == "__main__":
    _launcher_main(sys.argv[1:])
