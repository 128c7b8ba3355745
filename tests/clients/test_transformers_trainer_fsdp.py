"""ShardpointTrainer's checkpoint path with FSDP-sharded models on two gloo processes.

On CPU, Accelerate (1.15) turns its FSDP plugin on only for accelerator devices:
with ``use_cpu=True`` a ``TrainingArguments(fsdp=True, ...)`` run becomes plain
DDP (FSDP2, and FSDP1 without ``sync_module_states``; FSDP1 with it fails
building the plugin, asking for a GPU). So ``Trainer.train()`` cannot run FSDP
here. One check pins that: when Accelerate starts supporting it, it fails, and
this file should grow a full ``train()``/resume run.

What can run is everything ShardpointTrainer adds under FSDP: Trainer saves
``self.model`` (the sharded model under FSDP) and loads it after wrapping through
``_load_from_checkpoint(folder, model_wrapped)``. Here a GPT-2 is sharded per
block and at the root, as Accelerate's plugin does (FSDP2 ``fully_shard``, and
FSDP1 with ``use_orig_params``), and driven through those same hooks: a run
saves at step 2 and goes on to step 4; a fresh, differently initialised sharded
model resumes from step 2 and must end bit for bit equal, gathered weights,
optimizer state and learning rate alike.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from shardpoint.testing import launch  # noqa: E402

STEPS, SAVE_AT = 4, 2


def _config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
    return {"input_ids": ids, "labels": ids}


def _args(out: str, **extra: Any):
    from transformers import TrainingArguments

    return TrainingArguments(
        out, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=1, save_steps=SAVE_AT, report_to="none", use_cpu=True, seed=3, disable_tqdm=True, **extra,
    )


def _shard(model, version: int):
    """Shard ``model`` as Accelerate's FSDP plugin does: each GPT-2 block, then the root."""
    import functools

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    if version == 1:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sharded_trainer(out: str, seed: int, version: int):
    """A ShardpointTrainer holding a sharded GPT-2 and, created after sharding as under FSDP, its optimizer."""
    from transformers import GPT2LMHeadModel

    from shardpoint.integrations.transformers import ShardpointTrainer

    torch.manual_seed(seed)
    model = _shard(GPT2LMHeadModel(_config()), version)
    trainer = ShardpointTrainer(model=model, args=_args(out))
    trainer.model_wrapped = model  # under FSDP, Trainer's model and wrapped model are the sharded one
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    return trainer


def _step(trainer, step: int, rank: int) -> None:
    trainer.model.train()
    trainer.model(**_batch(step, rank)).loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad()
    trainer.state.global_step = step


def _weights(trainer) -> dict[str, torch.Tensor]:
    """The whole model on every process, gathered from the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


def _optimizer_state(trainer) -> dict[str, torch.Tensor]:
    """The whole optimizer state (per parameter name) on every process, gathered from the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{n}.{k}": v.clone() for n, s in full["state"].items() for k, v in s.items()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"names differ: {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def _plain_trainer_under_fsdp(out: str, version: int) -> dict[str, Any]:
    """What transformers.Trainer itself makes of the FSDP plugin on CPU (FSDP1 without sync_module_states)."""
    from transformers import GPT2LMHeadModel, Trainer

    args = _args(out, fsdp=True, fsdp_config={"version": version, "sync_module_states": "false", "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    t = Trainer(model=GPT2LMHeadModel(_config()), args=args)
    return {"distributed": str(t.accelerator.distributed_type), "fsdp": t.is_fsdp_enabled, "plugin": args.fsdp_plugin_args["fsdp_version"]}


def run(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """:func:`interrupted_run` under FSDP1 and FSDP2, in one process group."""
    return {str(v): interrupted_run(rank, root, v) for v in (1, 2)}


def interrupted_run(rank: int, root: str, version: int) -> dict[str, Any]:
    """A sharded run saved at step 2 and trained to 4; a fresh sharded model resumed from step 2 and trained to 4."""
    import shardpoint as sp
    from transformers import GPT2LMHeadModel

    out = os.path.join(root, f"fsdp{version}")
    full = _sharded_trainer(out, seed=1, version=version)
    for step in range(1, STEPS + 1):
        _step(full, step, rank)
        if step == SAVE_AT:
            full._save_checkpoint(full.model, trial=None)  # the hook Trainer calls at save_steps
            at_save = _weights(full)
    folder = os.path.join(out, f"checkpoint-{SAVE_AT}")

    resumed = _sharded_trainer(out, seed=2, version=version)
    fresh = _differ(_weights(resumed), at_save)
    # A run with a gradient scaler that the checkpoint lacks is refused, not half restored.
    resumed.accelerator.scaler, refused = torch.amp.GradScaler("cpu"), ""
    try:
        resumed._load_optimizer_and_scheduler(folder)
    except sp.KeyMismatchError as e:
        refused = str(e)
    resumed.accelerator.scaler = None
    # The hooks Trainer calls when resuming under FSDP: the model after wrapping, then optimizer, scheduler, generators.
    resumed._load_from_checkpoint(folder, resumed.model_wrapped)
    resumed._load_optimizer_and_scheduler(folder)
    resumed._load_rng_state(folder)  # dropout draws from the restored generators
    loaded = _differ(_weights(resumed), at_save)
    lr_loaded = resumed.lr_scheduler.get_last_lr()
    for step in range(SAVE_AT + 1, STEPS + 1):
        _step(resumed, step, rank)

    # The checkpoint names the plain model's parameters, so it also loads into an unsharded model.
    plain = GPT2LMHeadModel(_config())
    sp.load(folder, {"model": plain}, keys=["model", "model.*"])
    chunks = sp.read_manifest(folder, chunks=True).tensors["model.transformer.h.0.attn.c_attn.weight"].chunks
    return {
        "fresh_differs": len(fresh) > 0,
        "loaded": loaded,
        "refused": refused,
        "weights": _differ(_weights(resumed), _weights(full)),
        "optimizer": _differ(_optimizer_state(resumed), _optimizer_state(full)),
        "optimizer_entries": len(_optimizer_state(full)),
        "lr": [lr_loaded, resumed.lr_scheduler.get_last_lr(), full.lr_scheduler.get_last_lr()],
        "steps": [resumed.lr_scheduler.last_epoch, full.lr_scheduler.last_epoch],
        "unsharded": _differ({k: v for k, v in plain.state_dict().items() if k in at_save}, at_save),
        "c_attn": sorted([list(c.box.offsets), list(c.box.sizes), c.rank] for c in chunks),
        "folder": sorted(os.listdir(folder)),
        "trainer": _plain_trainer_under_fsdp(os.path.join(root, f"plain{version}"), version),
    }


@pytest.mark.dist
@pytest.mark.slow  # in `make test-slow`, which CI runs
def test_sharded_model_resumes_bit_exact_through_the_trainer_hooks(tmp_path):
    ranks = launch(2, "tests.clients.test_transformers_trainer_fsdp:run", {"root": str(tmp_path)}, timeout=300)
    for rank in ranks:
        for version, r in rank.items():
            assert r["fresh_differs"], "the resumed model must start from other weights than the saved ones"
            assert r["loaded"] == [], f"FSDP{version}: weights differ right after loading the checkpoint"
            assert r["weights"] == [], f"FSDP{version}: the resumed weights diverged from the uninterrupted run"
            assert r["optimizer"] == [], f"FSDP{version}: the resumed optimizer diverged from the uninterrupted run"
            assert r["optimizer_entries"] > 0
            assert "pattern(s) ['scaler']" in r["refused"], r["refused"]
            assert r["lr"][1] == r["lr"][2] and r["lr"][0] != r["lr"][1]
            assert r["steps"] == [STEPS, STEPS]
            assert r["unsharded"] == [], f"FSDP{version}: the checkpoint does not load into an unsharded model"
            assert "trainer_state.json" in r["folder"] and "optimizer.pt" not in r["folder"]
            # transformers.Trainer on CPU: Accelerate drops the FSDP plugin and runs DDP.
            assert r["trainer"] == {"distributed": "DistributedType.MULTI_CPU", "fsdp": False, "plugin": int(version)}
    # FSDP2 shards every parameter by rows: each process wrote its own half, nothing was gathered.
    assert ranks[0]["2"]["c_attn"] == [[[0, 0], [16, 96], 0], [[16, 0], [16, 96], 1]]
