"""ShardpointTrainer runs on gloo ranks (via ``shardpoint.testing.launch``) for the multi-process tests."""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from shardpoint.integrations.transformers import ShardpointTrainer  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Crash(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt("simulated crash")


def _trainer(out: str, callbacks=()) -> ShardpointTrainer:
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(
        out, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=1, save_steps=2, save_total_limit=2, logging_steps=1, report_to="none", use_cpu=True,
        seed=3, disable_tqdm=True, dataloader_num_workers=0,
    )
    return ShardpointTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def _lrs(t: ShardpointTrainer) -> list[list[float]]:
    return [[h["step"], h["learning_rate"], h["loss"]] for h in t.state.log_history if "loss" in h]


def run(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """An uninterrupted run, then a run that crashes after step 3 and one that resumes it; rank 0 saves weights."""
    full = _trainer(os.path.join(root, "full"))
    full.train()
    out = os.path.join(root, "resumed")
    try:
        _trainer(out, [Crash(3)]).train()
    except KeyboardInterrupt:
        pass
    resumed = _trainer(out)
    resumed.train(resume_from_checkpoint=True)
    if rank == 0:
        torch.save({"full": full.model.state_dict(), "resumed": resumed.model.state_dict()}, os.path.join(root, "weights.pt"))
    return {
        "distributed": str(full.accelerator.distributed_type),
        "full": _lrs(full),
        "resumed": _lrs(resumed),
        "folders": sorted(os.listdir(out)),
    }
