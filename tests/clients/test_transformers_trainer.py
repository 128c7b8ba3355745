"""ShardpointTrainer against what transformers.Trainer promises for its checkpoints.

A tiny GPT-2 built from a config (nothing downloaded) trains on CPU. A run
interrupted after a checkpoint and resumed with ``resume_from_checkpoint=True``
must end bit for bit where an uninterrupted run ends, learning-rate schedule
included; ``save_total_limit`` keeps the newest folders; ``trainer_state.json``
stays Trainer's, so best-model tracking works; the Hugging Face model files
are written only when asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import shardpoint as sp  # noqa: E402
from shardpoint.integrations.transformers import ShardpointTrainer, is_shardpoint_checkpoint, latest_checkpoint  # noqa: E402
from tests.clients.test_guides import script  # noqa: E402

STEPS, SAVE_EVERY, CRASH_AT = 8, 3, 5  # 5 steps per epoch: the resume at step 3 is mid-epoch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 20, seed: int = 0) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Record(TrainerCallback):
    """The learning rate each optimizer step used, read from the live scheduler."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.lrs: dict[int, float] = {}
        self.crash_at = crash_at

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        # After step N the scheduler has stepped N times; the rate step N used is the one before.
        self.lrs[state.global_step] = lr_scheduler.get_last_lr()[0]
        if state.global_step == self.crash_at:
            raise KeyboardInterrupt("simulated crash")


def trainer(out: str, callbacks=(), save_hf_model: bool = False, eval_dataset=None, **overrides) -> ShardpointTrainer:
    torch.manual_seed(1)  # the resumed run starts from the same init; the load must still replace it
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)  # dropout 0.1: RNG matters
    options = dict(
        max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
        save_steps=SAVE_EVERY, save_total_limit=2, logging_steps=1, report_to="none", use_cpu=True, seed=3,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    options.update(overrides)
    return ShardpointTrainer(
        model=GPT2LMHeadModel(config), args=TrainingArguments(out, **options), train_dataset=Tokens(),
        eval_dataset=eval_dataset, callbacks=list(callbacks), save_hf_model=save_hf_model,
    )


def weights(t: ShardpointTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    full_rec = Record()
    full = trainer(str(root / "full"), [full_rec])
    full.train()
    out = str(root / "resumed")
    crash_rec = Record(crash_at=CRASH_AT)
    with pytest.raises(KeyboardInterrupt):
        trainer(out, [crash_rec]).train()
    folders_after_crash = sorted(os.listdir(out))
    resumed_rec = Record()
    resumed = trainer(out, [resumed_rec])
    resumed.train(resume_from_checkpoint=True)
    return dict(full=full, full_rec=full_rec, resumed=resumed, resumed_rec=resumed_rec, crash_rec=crash_rec,
                root=root, out=out, after_crash=folders_after_crash)


def test_interrupted_and_resumed_run_is_bit_exact(runs):
    a, b = weights(runs["full"]), weights(runs["resumed"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the resume"
    opt_a = runs["full"].optimizer.optimizer.state_dict()["state"]
    opt_b = runs["resumed"].optimizer.optimizer.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and len(opt_a) > 0
    for i in opt_a:
        for name, v in opt_a[i].items():
            assert torch.equal(v, opt_b[i][name]), f"optimizer state {i}.{name} differs"
    assert runs["resumed"].state.global_step == STEPS


def test_learning_rate_schedule_resumes_where_it_stopped(runs):
    full, resumed = runs["full_rec"].lrs, runs["resumed_rec"].lrs
    assert sorted(full) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))  # resumed from checkpoint-3
    assert resumed == {s: full[s] for s in resumed}
    # A restarted schedule would warm up again from 0; this one is decaying.
    assert len(set(full.values())) >= STEPS - 1 and resumed[STEPS] < resumed[SAVE_EVERY + 1]
    # The logged history (rate and loss per step) matches the uninterrupted run's.
    def logged(t):
        return [(h["step"], h["learning_rate"], h["loss"]) for h in t.state.log_history if "loss" in h]
    assert logged(runs["resumed"]) == logged(runs["full"])
    assert len(logged(runs["full"])) == STEPS


def test_save_total_limit_and_checkpoint_contents(runs):
    assert runs["after_crash"] == ["checkpoint-3"]
    assert sorted(os.listdir(runs["out"])) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(os.listdir(runs["root"] / "full")) == ["checkpoint-6", "checkpoint-8"]
    folder = os.path.join(runs["out"], "checkpoint-6")
    assert is_shardpoint_checkpoint(folder)
    names = set(os.listdir(folder))
    assert "trainer_state.json" in names
    assert not names & {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"}
    manifest = sp.read_manifest(folder)
    assert {"model", "optimizer", "scheduler", "rng"} <= set(manifest.values) | {n.split(".")[0] for n in manifest.tensors}
    assert manifest.values["scheduler"]["last_epoch"] == 6
    assert torch.equal(sp.read_tensor(os.path.join(runs["root"], "full", "checkpoint-8"), "model.lm_head.weight"),
                       runs["full"].model.lm_head.weight.detach())
    with open(os.path.join(folder, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 6


def test_latest_skips_an_unfinished_save(runs, tmp_path):
    out = tmp_path / "out"
    for step in (4, 12):
        (out / f"checkpoint-{step}" / "data").mkdir(parents=True)
    assert latest_checkpoint(str(out)) is None
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        trainer(str(out)).train(resume_from_checkpoint=True)
    with pytest.raises(sp.IncompleteCheckpointError):
        trainer(str(out)).train(resume_from_checkpoint=str(out / "checkpoint-12"))
    assert latest_checkpoint(runs["out"]) == os.path.join(runs["out"], "checkpoint-8")


def test_a_checkpoint_written_by_trainer_resumes(tmp_path):
    # A run switched over from transformers.Trainer continues from Trainer's own files.
    plain = trainer(str(tmp_path / "plain"), max_steps=4, save_steps=2)
    plain = Trainer(model=plain.model, args=plain.args, train_dataset=Tokens())
    plain.train()
    assert "optimizer.pt" in os.listdir(tmp_path / "plain" / "checkpoint-2")
    switched = trainer(str(tmp_path / "switched"), max_steps=4, save_steps=2)
    switched.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    for k, v in weights(plain).items():
        assert torch.equal(v, switched.model.state_dict()[k]), f"{k} differs from Trainer's own resume"
    assert os.listdir(tmp_path / "switched") == ["checkpoint-4"]
    assert is_shardpoint_checkpoint(str(tmp_path / "switched" / "checkpoint-4"))


def test_hf_model_files_only_when_asked(tmp_path):
    t = trainer(str(tmp_path / "hf"), save_hf_model=True, max_steps=2, save_steps=2)
    t.train()
    folder = tmp_path / "hf" / "checkpoint-2"
    assert {"model.safetensors", "config.json", "trainer_state.json", "manifest.json"} <= set(os.listdir(folder))
    loaded = GPT2LMHeadModel.from_pretrained(str(folder))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, t.model.state_dict()[k]), k
    # The shardpoint checkpoint is what resumes, even with the HF files beside it.
    again = trainer(str(tmp_path / "hf"), max_steps=3, save_steps=2)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 3


def test_best_model_is_tracked_and_loaded_at_end(tmp_path):
    t = trainer(
        str(tmp_path / "best"), max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2, save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False, learning_rate=5e-2,
        eval_dataset=Tokens(8, seed=1),
    )
    t.train()
    best = t.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best) and is_shardpoint_checkpoint(best)
    evals = {h["step"]: h["eval_loss"] for h in t.state.log_history if "eval_loss" in h}
    assert best.endswith(f"checkpoint-{min(evals, key=evals.get)}")
    assert min(evals, key=evals.get) != 6  # the best is not the last: loading it changed the weights
    for name, value in t.model.state_dict().items():
        assert torch.equal(value, sp.read_tensor(best, f"model.{name}")), f"{name} is not the best checkpoint's"


def test_missing_transformers_raises_a_typed_error():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import shardpoint as sp\n"
        "try:\n"
        "    import shardpoint.integrations.transformers\n"
        "except sp.MissingDependencyError as e:\n"
        "    print('typed', e.package, e.hint)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "typed transformers pip install 'shardpoint[transformers]'"


def test_guide_example_runs(tmp_path, monkeypatch):
    # In this process: transformers is already imported, which is most of a fresh process's time.
    monkeypatch.chdir(tmp_path)
    code = compile(script("transformers.md"), "transformers.md", "exec")
    exec(code, {"__name__": "guide"})
    assert sorted(os.listdir(tmp_path)) == ["reference", "run", "with_hf"]
