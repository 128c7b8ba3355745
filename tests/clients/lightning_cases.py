"""Lightning training runs for the plugin tests: in this process, or on gloo ranks via ``launch``."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from shardpoint.integrations.lightning import AsyncShardpointCheckpointIO, ShardpointCheckpointIO, ShardpointFSDPStrategy

N, BATCH = 32, 4


class Net(L.LightningModule):
    """A small regression model with AdamW and a per-step scheduler, so all three carry state."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[list[Any]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.losses.append([self.global_step, loss.item()])
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def snapshot(trainer: L.Trainer) -> dict[str, Any]:
    """Model, optimizer and scheduler state, cloned (AdamW's step tensors are live otherwise)."""
    opt = trainer.optimizers[0]
    if isinstance(trainer.strategy, FSDPStrategy):  # full tensors, gathered from the shards (a collective)
        msd, osd = get_state_dict(trainer.model, opt, options=StateDictOptions(full_state_dict=True))
        return {
            "model": {k.split("layer.", 1)[1]: v.clone() for k, v in msd.items()},
            "optimizer": {
                fqn: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for fqn, s in osd["state"].items()
            },
            "scheduler": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
        }
    return {
        "model": {k: v.detach().clone() for k, v in trainer.lightning_module.layer.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()
        },
        "scheduler": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
    }


class Capture(Callback):
    """Keeps the state right after the restore (train start) and at the end of fit."""

    def __init__(self, resuming: bool) -> None:
        self.resuming = resuming
        self.start: dict[str, Any] | None = None
        self.epochs: dict[int, Any] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        if self.resuming:  # (gathering a never-stepped FSDP optimizer's state would initialise it)
            self.start = snapshot(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs[trainer.current_epoch] = snapshot(trainer)


class CPUFSDPStrategy(ShardpointFSDPStrategy):
    """FSDP on CPU: Lightning wraps with ``device_id=None`` there, which FSDP rejects without an accelerator."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if not any(isinstance(m, FSDP) for m in model.modules()):
            model = FSDP(model, device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)


def run(rank: int, world: int, *, ckpt_dir: str, epochs: int, out: str, resume: str | None = None,
        async_io: bool = False, strategy: str = "auto", keep: int = 1) -> dict[str, Any]:
    """Fit for ``epochs`` epochs (resuming from ``resume``), checkpointing each epoch, keeping the newest ``keep``."""
    L.seed_everything(0, verbose=False)
    model = Net()
    if strategy == "shardpoint_fsdp":
        strategy = CPUFSDPStrategy(auto_wrap_policy={nn.Linear})
    io = AsyncShardpointCheckpointIO() if async_io else ShardpointCheckpointIO()
    capture = Capture(resuming=resume is not None)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=keep, every_n_epochs=1), capture],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, data(), ckpt_path=resume)
    end = snapshot(trainer)
    if rank == 0:
        torch.save({"start": capture.start, "end": end, "epochs": capture.epochs}, out)
    return {"losses": model.losses, "files": sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []}
