"""torchtitan's own Llama, ``parallelize_llama``, optimizers and schedulers on CPU/gloo, for the integration tests.

torchtitan trains on CPU/gloo only after four changes, all made here (never in the library):

1. the device type is ``"cpu"`` (torchtitan assumes CUDA when no accelerator is found);
2. ``spmd_backend="partial_dtensor"``;
3. plain causal SDPA as the inner attention (flex attention has no CPU backward, varlen no CPU kernel);
4. ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (gloo has no ``PREMUL_SUM``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F

import torchtitan.distributed.parallel_dims as _titan_parallel_dims  # noqa: E402
import torchtitan.tools.utils as _titan_utils  # noqa: E402

_titan_utils.device_type = "cpu"  # change 1
_titan_parallel_dims.device_type = "cpu"

from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as titan_dist  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.parallelize import parallelize_llama  # noqa: E402

SEQ, BATCH = 32, 2


class CausalSDPA(nn.Module):
    """Change 3: causal ``scaled_dot_product_attention`` on (batch, length, heads, head_dim) inputs."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


class TrainerConfig:
    """The parts of torchtitan's ``Trainer.Config`` (debug Llama) that building the model and optimizers reads."""

    def __init__(self) -> None:
        self.model_spec = model_registry("debugmodel")
        self.training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=8)
        self.parallelism = ParallelismConfig(spmd_backend="partial_dtensor")  # change 2
        self.compile = CompileConfig()
        self.optimizer = default_adamw(lr=8e-4)
        self.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)


def trainer_config() -> TrainerConfig:
    return TrainerConfig()


def build(world: int, seed: int = 0) -> dict[str, Any]:
    """Model parts, optimizers and schedulers as torchtitan's Trainer builds them, sharded over ``world`` ranks."""
    config = trainer_config()
    titan_dist.set_spmd_backend("partial_dtensor")
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    model_config = config.model_spec.model
    with torch.device("meta"):
        model = model_config.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()
    model = parallelize_llama(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                              compile_config=config.compile, ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # change 4
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    return {"config": config, "model_parts": [model], "optimizers": optimizers, "lr_schedulers": schedulers,
            "vocab": model.tok_embeddings.weight.shape[0]}


def batch(step: int, rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(parts: dict[str, Any], step: int) -> float:
    model = parts["model_parts"][0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    x, y = batch(step, rank, parts["vocab"])
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    parts["optimizers"].step()
    parts["lr_schedulers"].step()
    parts["optimizers"].zero_grad()
    return loss.item()




class TrainState:
    """The trainer's own ``Stateful`` part, as torchtitan's ``Trainer`` keeps it."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


def _full(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return v


def snapshot(parts: dict[str, Any], ts: TrainState) -> dict[str, Any]:
    """Full tensors of model and optimizer state (a collective), the schedulers and the train state."""
    model = parts["model_parts"][0]
    return {
        # model.state_dict(): the names its hooks give (the fused QKV weight split into wq, wk and wv).
        "model": {k: _full(v) for k, v in model.state_dict().items()},
        "optimizer": {k: _full(v) for k, v in parts["optimizers"].state_dict().items()},
        "lr": parts["lr_schedulers"].state_dict(),
        "train": ts.state_dict(),
    }


def manager_for(kind: str, parts: dict[str, Any], ts: TrainState, base: str, interval: int, async_save: bool = False):
    if kind == "dcp":
        from torchtitan.components.checkpointer import CheckpointManager

        cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=interval, keep_latest_k=0,
                                       last_save_model_only=False)
    else:
        from shardpoint.integrations.torchtitan import ShardpointCheckpointManager

        cfg = ShardpointCheckpointManager.Config(enable=True, folder="checkpoint", interval=interval, keep_latest_k=0,
                                                 last_save_model_only=False, async_save=async_save)
    return cfg.build(dataloader=None, model_parts=parts["model_parts"], optimizers=parts["optimizers"],
                     lr_schedulers=parts["lr_schedulers"], states={"train_state": ts}, sd_adapter=None, base_folder=base)


def run(rank: int, world: int, *, base: str, out: str, phase: str, kind: str = "shardpoint",
        steps: int = 6, at: int = 3, async_save: bool = False) -> dict[str, Any]:
    """``full``: train ``steps`` steps, saving at step ``at``; ``resume``: load step ``at`` and train the rest."""
    parts = build(world, seed=0 if phase == "full" else 1)
    ts = TrainState()
    manager = manager_for(kind, parts, ts, base, interval=at, async_save=async_save)
    losses, mid = [], None
    if phase == "resume":
        assert manager.load(step=at)
        assert ts.step == at
        mid = snapshot(parts, ts)
    for s in range(ts.step + 1, steps + 1):
        losses.append(train_step(parts, s))
        ts.step, ts.ntokens_seen = s, ts.ntokens_seen + BATCH * SEQ
        manager.save(curr_step=s, last_step=False)
        if phase == "full" and s == at:
            mid = snapshot(parts, ts)
    manager.maybe_wait_for_saving()
    end = snapshot(parts, ts)
    manager.close()
    if rank == 0:
        torch.save({"mid": mid, "end": end}, out)
    return {"losses": losses}
