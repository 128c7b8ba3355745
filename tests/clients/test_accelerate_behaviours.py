"""Accelerate's documented checkpoint behaviours, run through shardpoint.integrations.accelerate.

What ``Accelerator.save_state`` / ``load_state`` promise: the state hooks are
called with ``(models, weights, output_dir)`` and ``(models, input_dir)`` and
what they take over is left to them; ``ProjectConfiguration`` names folders
``checkpoints/checkpoint_<iteration>``, keeps ``total_limit`` of them and
loads the newest when no folder is given; ``map_location`` and
``safe_serialization`` are accepted; registered objects are restored; and a
resumed run continues exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import shardpoint as sp  # noqa: E402
from shardpoint.integrations.accelerate import checkpoint_folders, load_state, save_state  # noqa: E402


class Counter:
    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def setup(seed: int, project: str | None = None, total_limit: int | None = None, iteration: int = 0):
    config = ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=project is not None, total_limit=total_limit, iteration=iteration
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, opt, sched, counter


def train(run, steps) -> list[float]:
    accelerator, model, opt, sched, counter = run
    losses = []
    for step in steps:
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).cos())
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        losses.append(loss.item())
    return losses


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def test_hooks_get_accelerates_arguments(tmp_path):
    run = setup(0)
    accelerator, model = run[0], run[1]
    train(run, range(2))
    calls = []
    save_handle = accelerator.register_save_state_pre_hook(lambda m, w, d: calls.append(("save", m, w, d)))
    load_handle = accelerator.register_load_state_pre_hook(lambda m, d: calls.append(("load", m, d)))
    path = str(tmp_path / "ck")
    save_state(accelerator, path)
    load_state(accelerator, path)
    (_, models, ws, out), (_, lmodels, lin) = calls
    assert out == path and lin == path
    assert len(models) == 1 and models[0] is model and len(lmodels) == 1 and lmodels[0] is model
    assert len(ws) == 1
    assert_equal(dict(ws[0]), weights(model))
    save_handle.remove()
    load_handle.remove()
    save_state(accelerator, str(tmp_path / "ck2"))
    assert len(calls) == 2  # removed hooks are not called


def test_hooks_that_take_over_a_model_are_honoured(tmp_path):
    # The diffusers pattern: the hook writes the model itself and pops its weights;
    # on load the hook restores it and pops it from the models to load.
    run = setup(0)
    accelerator, model = run[0], run[1]
    train(run, range(3))

    def save_hook(models, ws, output_dir):
        for m in models:
            torch.save(m.state_dict(), os.path.join(output_dir, "own_model.pt"))
            ws.pop()

    def load_hook(models, input_dir):
        while models:
            models.pop().load_state_dict(torch.load(os.path.join(input_dir, "own_model.pt")))

    accelerator.register_save_state_pre_hook(save_hook)
    path = str(tmp_path / "ck")
    os.makedirs(path)
    saved = weights(model)
    save_state(accelerator, path)
    manifest = sp.read_manifest(path)
    assert not [n for n in manifest.tensors if n.startswith("model_")], "a popped model must not be saved"
    assert "optimizer_0.state.model_0.0.weight.exp_avg" not in manifest.tensors  # named by position, no model
    assert os.path.isfile(os.path.join(path, "own_model.pt"))

    fresh = setup(5)
    fresh[0].register_load_state_pre_hook(load_hook)
    load_state(fresh[0], path)
    assert_equal(weights(fresh[1]), saved)
    assert fresh[4].seen == 3


def test_a_hook_that_edits_weights_saves_what_it_left(tmp_path):
    run = setup(0)
    accelerator, model = run[0], run[1]

    def keep_first_layer(models, ws, output_dir):
        ws[0] = {k: v for k, v in ws[0].items() if k.startswith("0.")}

    accelerator.register_save_state_pre_hook(keep_first_layer)
    path = str(tmp_path / "ck")
    save_state(accelerator, path)
    names = {n for n in sp.read_manifest(path).tensors if n.startswith("model_0.")}
    assert names == {"model_0.0.weight", "model_0.0.bias"}
    assert torch.equal(sp.read_tensor(path, "model_0.0.weight"), model[0].weight.detach())
    fresh = setup(3)
    with pytest.raises(sp.KeyMismatchError, match="model_0.3.weight"):
        load_state(fresh[0], path)
    load_state(fresh[0], path, load_kwargs={"strict": False})
    assert torch.equal(fresh[1][0].weight, model[0].weight) and not torch.equal(fresh[1][3].weight, model[3].weight)


def test_automatic_naming_total_limit_and_latest(tmp_path):
    project = str(tmp_path / "project")
    run = setup(0, project, total_limit=2)
    saved = []
    for i in range(3):
        train(run, range(2 * i, 2 * i + 2))
        result = save_state(run[0])
        saved.append(weights(run[1]))
        assert result.path.endswith(os.path.join("checkpoints", f"checkpoint_{i}"))
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]
    assert run[0].project_configuration.iteration == 3
    assert [os.path.basename(p) for p in checkpoint_folders(run[0])] == ["checkpoint_1", "checkpoint_2"]

    resumed = setup(9, project, total_limit=2)
    report = load_state(resumed[0])  # no folder: the newest
    assert report.path.endswith("checkpoint_2")
    assert_equal(weights(resumed[1]), saved[2])
    assert resumed[4].seen == 6 and resumed[3].state_dict()["last_epoch"] == 6
    assert resumed[0].project_configuration.iteration == 0  # as with Accelerate, loading does not move it
    with pytest.raises(ValueError, match="checkpoint_2 already exists"):
        resumed[0].project_configuration.iteration = 2
        save_state(resumed[0])
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]


def test_latest_skips_an_uncommitted_folder(tmp_path):
    project = str(tmp_path / "project")
    run = setup(0, project)
    train(run, range(2))
    save_state(run[0])
    os.makedirs(os.path.join(project, "checkpoints", "checkpoint_7"))  # a save that never committed
    resumed = setup(1, project)
    assert load_state(resumed[0]).path.endswith("checkpoint_0")
    assert_equal(weights(resumed[1]), weights(run[1]))


def test_no_folder_and_no_automatic_naming_is_refused(tmp_path):
    run = setup(0)
    with pytest.raises(ValueError, match="automatic checkpoint naming is disabled"):
        save_state(run[0])
    with pytest.raises(ValueError, match="automatic checkpoint naming is disabled"):
        load_state(run[0])
    empty = setup(0, str(tmp_path / "p"))
    with pytest.raises(sp.CheckpointNotFoundError, match="no committed checkpoint"):
        load_state(empty[0])


def test_accelerate_keywords_are_accepted_and_unknown_ones_refused(tmp_path):
    run = setup(0)
    train(run, range(2))
    path = str(tmp_path / "ck")
    save_state(run[0], path, safe_serialization=False)
    save_state(run[0], path, safe_serialization=True)
    fresh = setup(4)
    load_state(fresh[0], path, map_location="cpu")
    assert_equal(weights(fresh[1]), weights(run[1]))
    load_state(fresh[0], path, map_location="on_device")
    with pytest.raises(TypeError, match="bogus"):
        save_state(run[0], path, bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        load_state(fresh[0], path, bogus=1)
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed: 'invalid'"):
        load_state(fresh[0], path, map_location="invalid")
    with pytest.raises(TypeError, match="assign"):
        load_state(fresh[0], path, load_kwargs={"assign": True})


def test_resume_is_bit_exact_with_registered_objects(tmp_path):
    project = str(tmp_path / "project")
    run = setup(0, project)
    train(run, range(4))
    save_state(run[0])
    after = train(run, range(4, 8))
    final = weights(run[1])

    resumed = setup(123, project)  # other weights and generator state: the load replaces both
    load_state(resumed[0])
    assert resumed[4].seen == 4
    assert train(resumed, range(4, 8)) == after  # dropout masks included
    assert_equal(weights(resumed[1]), final)
    assert resumed[3].state_dict() == run[3].state_dict()
    for a, b in zip(resumed[2].optimizer.state.values(), run[2].optimizer.state.values()):
        assert_equal(a, b)


@pytest.mark.dist
def test_two_processes_hooks_on_the_main_process_and_automatic_naming(tmp_path):
    from shardpoint.testing import launch

    project = str(tmp_path / "project")
    ranks = launch(2, "tests.clients.accelerate_cases:hooks_and_naming", {"project": project}, timeout=240)
    for r in ranks:
        assert r == {"folders": ["checkpoint_1", "checkpoint_2"], "loaded": "checkpoint_2", "model_equal": True, "counter": 6}
    manifest = sp.read_manifest(os.path.join(project, "checkpoints", "checkpoint_2"))
    # The main process's hook took the model over, so no process saved it.
    assert not [n for n in manifest.tensors if n.startswith("model_")]
    assert "optimizer_0" in {n.split(".")[0] for n in manifest.tensors}
