"""Accelerate training runs for the integration tests: in this process, or on gloo ranks via ``launch``."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn import functional as F

from shardpoint.integrations.accelerate import load_state, save_state


class Counter:
    """A registered object with its own state: how many batches it has seen."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch per (step, rank), independent of the global generators."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def build(accelerator: Accelerator, seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    # Dropout draws from the global generator, so the restored RNG state shows in the losses.
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    accelerator.register_for_checkpointing(counter)
    return model, opt, sched, counter


def snapshot(accelerator: Accelerator, model, opt, sched, counter) -> dict[str, Any]:
    inner = getattr(opt, "optimizer", opt)
    return {
        "model": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in inner.state_dict()["state"].items()},
        "scheduler": dict(sched.state_dict()),
        "counter": counter.seen,
        "step": accelerator.step,
    }


def train(accelerator: Accelerator, model, opt, sched, counter, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, accelerator.process_index)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.seen += 1
        losses.append(loss.item())
    return losses


def run(rank: int, world: int, *, path: str, out: str, phase: str, steps: int = 8) -> dict[str, Any]:
    """``full`` trains ``steps`` steps, saving after half; ``resume`` loads that and trains the rest.

    Half is a whole number of accumulation windows: gradients accumulated mid-window are not state.
    """
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    half = steps // 2
    # The resumed run starts from other weights and another generator state: the load must replace both.
    objs = build(accelerator, seed=7 if phase == "resume" else 0)
    if phase == "full":
        losses = train(accelerator, *objs, range(half))
        save_state(accelerator, path)
        mid = snapshot(accelerator, *objs)
        losses += train(accelerator, *objs, range(half, steps))
    else:
        load_state(accelerator, path)
        mid = snapshot(accelerator, *objs)
        losses = train(accelerator, *objs, range(half, steps))
    end = snapshot(accelerator, *objs)
    if rank == 0:
        torch.save({"mid": mid, "end": end}, out)
    accelerator.end_training()
    return {"losses": losses, "distributed": str(accelerator.distributed_type)}


def hooks_and_naming(rank: int, world: int, *, project: str) -> dict[str, Any]:
    """Automatic naming with total_limit=2 and a diffusers-style hook that only the main process runs.

    The main process saves model 0 itself and pops its weights; the other
    processes leave theirs, as in scripts that guard the hook with
    ``is_main_process``. Then a fresh accelerator loads the newest checkpoint.
    """
    import os

    from accelerate.utils import ProjectConfiguration

    from shardpoint.integrations.accelerate import checkpoint_folders

    def config(iteration: int = 0) -> ProjectConfiguration:
        return ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2, iteration=iteration)

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            torch.save(accelerator.unwrap_model(models[0]).state_dict(), os.path.join(output_dir, "own.pt"))
            weights.pop(0)

    def load_hook(models, input_dir):
        accelerator2.unwrap_model(models.pop(0)).load_state_dict(torch.load(os.path.join(input_dir, "own.pt")))

    accelerator = Accelerator(cpu=True, project_config=config())
    objs = build(accelerator, seed=0)
    accelerator.register_save_state_pre_hook(save_hook)
    for i in range(3):
        train(accelerator, *objs, range(2 * i, 2 * i + 2))
        save_state(accelerator)
    saved = snapshot(accelerator, *objs)
    folders = [os.path.basename(p) for p in checkpoint_folders(accelerator)]

    accelerator2 = Accelerator(cpu=True, project_config=config(iteration=3))
    objs2 = build(accelerator2, seed=5)
    accelerator2.register_load_state_pre_hook(load_hook)
    path = load_state(accelerator2).path
    loaded = snapshot(accelerator2, *objs2)
    same = all(torch.equal(v, loaded["model"][k]) for k, v in saved["model"].items())
    accelerator2.end_training()
    return {"folders": folders, "loaded": os.path.basename(path), "model_equal": same, "counter": loaded["counter"]}
