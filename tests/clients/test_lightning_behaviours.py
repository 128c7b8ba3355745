"""Lightning's documented checkpoint behaviours, run through the shardpoint plugins with real Lightning on CPU.

What Lightning promises, and what each test holds the plugins to:

- ``ModelCheckpoint`` keeps the ``save_top_k`` best checkpoints, deletes the
  others through the plugin, and with ``save_last=True`` rewrites ``last.ckpt``;
- ``trainer.fit(ckpt_path=...)`` resumes exactly where the run stopped;
- ``load_from_checkpoint`` rebuilds the module (or datamodule) from the
  hyperparameters ``save_hyperparameters()`` stored, keyword arguments
  overriding them, calls ``on_load_checkpoint``, and honours ``strict``,
  ``strict_loading`` and ``map_location``;
- hyperparameters of common types survive a checkpoint;
- ``trainer.save_checkpoint`` over an existing file replaces it, and a run
  saved by Lightning's default ``TorchCheckpointIO`` resumes through the plugin;
- a missing checkpoint raises ``FileNotFoundError``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import os
import pathlib
import threading
import time

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import shardpoint as sp  # noqa: E402
from shardpoint.engine.inflight import saves_in_flight, track_save  # noqa: E402
from shardpoint.integrations.lightning import (  # noqa: E402
    AsyncShardpointCheckpointIO,
    ShardpointCheckpointIO,
    load_from_checkpoint,
)

N, BATCH = 32, 8


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Optim:
    lr: float = 1e-2
    betas: tuple = (0.9, 0.99)
    out: pathlib.Path = pathlib.Path("runs")


class Regressor(L.LightningModule):
    """Every hyperparameter kind the guide promises, with AdamW and a per-step scheduler."""

    def __init__(self, width: int = 16, root=pathlib.Path("/data"), device_hint=torch.device("cpu"),
                 dtype=torch.float32, mode=Mode.FAST, optim=Optim(), extra=None, big: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        if big:  # a large buffer, so that an asynchronous save takes a while
            self.register_buffer("ballast", torch.arange(big, dtype=torch.float32))
        self.seen_checkpoint_keys: list[str] | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.optim.lr, betas=self.hparams.optim.betas)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint):
        self.seen_checkpoint_keys = sorted(checkpoint)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = BATCH, root=pathlib.Path("/data")):
        super().__init__()
        self.save_hyperparameters()
        self.served = 0

    def train_dataloader(self):
        self.served += 1
        g = torch.Generator().manual_seed(1)
        x = torch.randn(N, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=self.hparams.batch_size)

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]


def trainer(epochs: int, io=None, dirpath=None, **ckpt) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=dirpath, **ckpt)] if dirpath else []
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", plugins=[io] if io is not None else [], callbacks=callbacks,
        enable_checkpointing=bool(dirpath), logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


def fit(epochs: int, io=None, dirpath=None, resume=None, hp=None, **ckpt) -> tuple[L.Trainer, Regressor]:
    L.seed_everything(0, verbose=False)
    model = Regressor(**(hp or {}))
    t = trainer(epochs, io, dirpath, **ckpt)
    t.fit(model, Data(), ckpt_path=resume)
    return t, model


def assert_same_training_state(a: L.Trainer, b: L.Trainer) -> None:
    sa, sb = a.lightning_module.state_dict(), b.lightning_module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"model tensor {k} differs"
    oa, ob = a.optimizers[0].state_dict()["state"], b.optimizers[0].state_dict()["state"]
    assert oa.keys() == ob.keys() and oa
    for i in oa:
        for k in oa[i]:
            assert torch.equal(oa[i][k], ob[i][k]), f"optimizer state {i}.{k} differs"
    assert a.lr_scheduler_configs[0].scheduler.state_dict() == b.lr_scheduler_configs[0].scheduler.state_dict()
    assert a.global_step == b.global_step


@pytest.fixture(scope="module")
def uninterrupted():
    """Three epochs in one go, no checkpoints: what every resumed run must equal."""
    return fit(3)[0]


@pytest.mark.parametrize("io_cls", [ShardpointCheckpointIO, AsyncShardpointCheckpointIO], ids=["sync", "async"])
def test_top_k_and_last_are_kept_the_rest_removed(tmp_path, io_cls, uninterrupted):
    d = tmp_path / "ck"
    t, _ = fit(3, io_cls(), str(d), save_top_k=2, monitor="step", mode="max", save_last=True)
    assert sorted(os.listdir(d)) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    assert all((d / n).is_dir() for n in os.listdir(d))  # each a shardpoint checkpoint folder
    assert t.checkpoint_callback.best_model_path == str(d / "epoch=2-step=12.ckpt")
    assert sp.read_manifest(str(d / "last.ckpt")).values["global_step"] == 12
    # Resuming from last.ckpt after the run finished: nothing left to train, state as saved.
    again, _ = fit(3, io_cls(), resume=str(d / "last.ckpt"))
    assert_same_training_state(again, uninterrupted)


def test_resume_from_last_is_bit_exact(tmp_path, uninterrupted):
    d = tmp_path / "ck"
    fit(2, AsyncShardpointCheckpointIO(), str(d), save_last=True)
    resumed, _ = fit(3, ShardpointCheckpointIO(), resume=str(d / "last.ckpt"))
    assert_same_training_state(resumed, uninterrupted)


def test_load_from_checkpoint_rebuilds_the_trained_model_and_its_hyperparameters(tmp_path):
    hp = dict(width=12, root=pathlib.Path("/mnt/run"), device_hint=torch.device("cuda", 1),
              dtype=torch.bfloat16, mode=Mode.SLOW, optim=Optim(lr=3e-3, out=pathlib.PurePosixPath("/o")),
              extra={"ns": argparse.Namespace(k=1, p=pathlib.Path("x")), Mode.FAST: [pathlib.Path("a")]})
    t, model = fit(1, ShardpointCheckpointIO(), str(tmp_path / "ck"), hp=hp)
    path = t.checkpoint_callback.best_model_path
    loaded = load_from_checkpoint(Regressor, path)
    assert type(loaded) is Regressor and loaded is not model
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert dict(loaded.hparams) == {**hp, "big": 0}
    assert type(loaded.hparams.root) is type(hp["root"]) and type(loaded.hparams.optim.out) is pathlib.PurePosixPath
    assert loaded.hparams.mode is Mode.SLOW and loaded.hparams.extra["ns"].p == pathlib.Path("x")
    assert loaded.net[0].out_features == 12  # built from the saved width
    assert loaded.seen_checkpoint_keys is not None and "state_dict" in loaded.seen_checkpoint_keys
    # Keyword arguments override the saved hyperparameters.
    overridden = load_from_checkpoint(Regressor, path, mode=Mode.FAST, strict=True)
    assert overridden.hparams.mode is Mode.FAST and overridden.hparams.width == 12
    # The datamodule of the same run comes back from the same checkpoint.
    dm = load_from_checkpoint(Data, path, batch_size=4)
    assert dm.hparams.batch_size == 4 and dm.hparams.root == pathlib.Path("/data") and dm.served == 1


def test_load_from_checkpoint_strict_and_map_location(tmp_path):
    t, _ = fit(1, ShardpointCheckpointIO(), str(tmp_path / "ck"))
    path = t.checkpoint_callback.best_model_path

    class Wider(Regressor):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.head = nn.Linear(1, 1)

    with pytest.raises(RuntimeError, match="Missing key"):
        load_from_checkpoint(Wider, path)
    with pytest.warns(UserWarning, match="head.weight"):
        partial = load_from_checkpoint(Wider, path, strict=False)
    assert torch.equal(partial.net[0].weight, t.lightning_module.net[0].weight)

    class Lenient(Wider):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.strict_loading = False

    with pytest.warns(UserWarning, match="head.weight"):
        load_from_checkpoint(Lenient, path)  # strict=None follows strict_loading
    with pytest.raises(ValueError, match="strict_loading"):
        load_from_checkpoint(Lenient, path, strict=True)
    for where in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda storage, loc: storage):
        m = load_from_checkpoint(Regressor, path, map_location=where)
        assert m.net[0].weight.device.type == "cpu" and m.device.type == "cpu"
        assert torch.equal(m.net[0].weight, t.lightning_module.net[0].weight)
    for where in ("meta", {"cpu": "meta"}):  # tensors go where it says
        got = ShardpointCheckpointIO().load_checkpoint(path, map_location=where)
        assert got["state_dict"]["net.0.weight"].device.type == "meta"
        assert got["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "meta"


class Act(enum.Enum):
    RELU = "relu"


def test_hyperparameters_needing_pickle_name_both_fixes(tmp_path):
    act = functools.partial(torch.clamp, min=0.0)
    with pytest.raises(sp.UnsupportedStateError) as err:
        fit(1, ShardpointCheckpointIO(), str(tmp_path / "a"), hp={"extra": {"act": act}})
    msg = str(err.value)
    assert "hyperparameter 'extra'" in msg and "partial" in msg
    assert "plain type" in msg and "ShardpointCheckpointIO(allow_pickle=True)" in msg
    assert "save_hyperparameters(ignore=['extra'])" in msg
    with pytest.raises(sp.UnsupportedStateError, match=r"AsyncShardpointCheckpointIO\(allow_pickle=True\)"):
        AsyncShardpointCheckpointIO().save_checkpoint({"hyper_parameters": {"act": act}}, str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()  # refused before anything was written

    t, _ = fit(1, ShardpointCheckpointIO(allow_pickle=True), str(tmp_path / "c"), hp={"extra": {"act": act}})
    path = t.checkpoint_callback.best_model_path
    with pytest.raises(sp.FormatError, match=r"weights_only=False"):
        load_from_checkpoint(Regressor, path)
    back = load_from_checkpoint(Regressor, path, weights_only=False)
    assert back.hparams.extra["act"].func is torch.clamp and back.hparams.extra["act"].keywords == {"min": 0.0}
    assert back.hparams.optim == Optim()  # the dataclass is stored without pickle either way
    io = AsyncShardpointCheckpointIO(allow_pickle=True)
    io.save_checkpoint({"hyper_parameters": {"act": act, "o": Optim(lr=1.0)}}, str(tmp_path / "d"))
    got = io.load_checkpoint(str(tmp_path / "d"))["hyper_parameters"]
    assert got["act"].keywords == {"min": 0.0} and got["o"] == Optim(lr=1.0)


def test_a_run_saved_by_the_default_torch_plugin_resumes_through_shardpoint(tmp_path, uninterrupted):
    d = tmp_path / "ck"
    fit(2, None, str(d), save_last=True)  # Lightning's own TorchCheckpointIO
    assert (d / "last.ckpt").is_file()
    resumed, _ = fit(3, ShardpointCheckpointIO(), str(d), resume=str(d / "last.ckpt"), save_last=True)
    assert_same_training_state(resumed, uninterrupted)
    # The plugin's own last.ckpt replaced the file (saving over a file).
    assert (d / "last.ckpt").is_dir() and sp.read_manifest(str(d / "last.ckpt")).values["global_step"] == 12
    assert [n for n in os.listdir(d) if n.startswith(".")] == []  # nothing left beside it


def test_a_torch_file_loads_safely_and_refuses_what_needs_pickle(tmp_path):
    path = tmp_path / "old.ckpt"
    hp = {"mode": Act.RELU, "optim": Optim(), "root": pathlib.Path("/r"), "ns": argparse.Namespace(a=1)}
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hp}, path)
    got = ShardpointCheckpointIO().load_checkpoint(path)  # weights_only=True, with these plain classes allowed
    assert got["hyper_parameters"] == hp and torch.equal(got["state_dict"]["w"], torch.ones(2))
    model = load_from_checkpoint(Regressor, path, strict=False, width=3)  # a torch file through load_from_checkpoint
    assert model.hparams.mode is Act.RELU and model.net[0].out_features == 3

    torch.save({"state_dict": {}, "hyper_parameters": {"act": functools.partial(torch.clamp, min=0.0)}}, path)
    with pytest.raises(sp.UnsupportedStateError, match=r"functools.partial.*allow_pickle=True"):
        ShardpointCheckpointIO().load_checkpoint(path)
    got = ShardpointCheckpointIO(allow_pickle=True).load_checkpoint(path)
    assert got["hyper_parameters"]["act"].keywords == {"min": 0.0}
    got = ShardpointCheckpointIO().load_checkpoint(path, weights_only=False)  # the caller's own opt-in
    assert got["hyper_parameters"]["act"].func is torch.clamp
    with pytest.raises(sp.UnsupportedStateError):
        ShardpointCheckpointIO(allow_pickle=True).load_checkpoint(path, weights_only=True)


@pytest.mark.parametrize("io_cls", [ShardpointCheckpointIO, AsyncShardpointCheckpointIO], ids=["sync", "async"])
def test_saving_over_a_file_replaces_it(tmp_path, io_cls):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"an old checkpoint file")
    io = io_cls()
    io.save_checkpoint({"state_dict": {"w": torch.arange(5.0)}, "epoch": 3}, str(path))
    got = io.load_checkpoint(str(path))
    assert path.is_dir() and got["epoch"] == 3 and torch.equal(got["state_dict"]["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    io.save_checkpoint({"state_dict": {"w": torch.zeros(5)}, "epoch": 4}, str(path))  # and over a checkpoint
    assert io.load_checkpoint(str(path))["epoch"] == 4


def test_trainer_save_checkpoint_over_a_file(tmp_path):
    t, _ = fit(1, ShardpointCheckpointIO())
    target = tmp_path / "model.ckpt"
    target.write_bytes(b"x" * 100)
    t.save_checkpoint(target)
    assert target.is_dir()
    back = load_from_checkpoint(Regressor, target)
    assert torch.equal(back.net[2].weight, t.lightning_module.net[2].weight)
    slim = tmp_path / "weights.ckpt"
    t.save_checkpoint(slim, weights_only=True)  # model weights and loops, no optimizer state
    assert "optimizer_states" not in ShardpointCheckpointIO().load_checkpoint(slim)
    assert torch.equal(load_from_checkpoint(Regressor, slim).net[0].bias, t.lightning_module.net[0].bias)


def test_a_second_async_plugin_loads_a_save_still_in_flight(tmp_path, uninterrupted):
    """A new Trainer with its own plugin resumes from a checkpoint the first one is still writing."""
    big = 8 << 20  # 32 MiB of buffer: the background write takes a while
    first, _ = fit(3, AsyncShardpointCheckpointIO(), hp={"big": big})
    path = str(tmp_path / "manual.ckpt")
    first.save_checkpoint(path)  # returns once staged; fit is over, so nothing waits for it
    assert saves_in_flight(path) == 1
    second = trainer(3, AsyncShardpointCheckpointIO())
    L.seed_everything(0, verbose=False)
    second.fit(Regressor(big=big), Data(), ckpt_path=path)  # nothing left to train: the state as saved
    assert saves_in_flight(path) == 0
    assert_same_training_state(second, first)
    direct = AsyncShardpointCheckpointIO().load_checkpoint(path)
    assert torch.equal(direct["state_dict"]["ballast"], torch.arange(big, dtype=torch.float32))


def test_any_load_waits_for_a_tracked_save_of_its_path(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"x": torch.ones(3)})
    done = threading.Event()
    track_save(os.path.join(str(tmp_path), ".", "ck"), done)  # another spelling of the same path
    out: list = []
    reader = threading.Thread(target=lambda: out.append(sp.load(path, {}, strict=False)))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive() and not out  # blocked while the save runs
    done.set()
    reader.join(10)
    assert torch.equal(out[0]["x"], torch.ones(3))


def test_lightning_async_wrapper_keeps_top_k_and_last_exact(tmp_path, uninterrupted):
    d = tmp_path / "ck"
    t, _ = fit(3, AsyncCheckpointIO(ShardpointCheckpointIO()), str(d), save_top_k=1, monitor="step", mode="max",
               save_last=True)
    assert sorted(os.listdir(d)) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert_same_training_state(t, uninterrupted)
    resumed, _ = fit(3, ShardpointCheckpointIO(), resume=str(d / "last.ckpt"))
    assert_same_training_state(resumed, uninterrupted)


def test_a_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError):
        ShardpointCheckpointIO().load_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        fit(1, ShardpointCheckpointIO(), resume=missing)
    try:  # user code that starts fresh when there is no checkpoint
        load_from_checkpoint(Regressor, missing)
        raise AssertionError("no error")
    except FileNotFoundError as e:
        assert isinstance(e, sp.CheckpointNotFoundError) and isinstance(e, sp.CheckpointError)
        assert e.errno == 2 and "nope.ckpt" in str(e)


def test_a_torch_file_in_object_storage_loads_and_is_removed(monkeypatch):
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    import io

    import boto3

    from tests.storage.s3_helpers import make_bucket, moto_server

    with moto_server() as endpoint:
        for k, v in dict(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                         AWS_DEFAULT_REGION="us-east-1").items():
            monkeypatch.setenv(k, v)
        bucket = make_bucket(endpoint)
        blob = io.BytesIO()
        torch.save({"state_dict": {"w": torch.arange(3.0)}, "hyper_parameters": {"root": pathlib.Path("/r")}}, blob)
        boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key="run/last.ckpt", Body=blob.getvalue())
        path = f"s3://{bucket}/run/last.ckpt"
        plugin = ShardpointCheckpointIO()
        got = plugin.load_checkpoint(path)
        assert torch.equal(got["state_dict"]["w"], torch.arange(3.0)) and got["hyper_parameters"]["root"] == pathlib.Path("/r")
        plugin.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 5}, path)
        assert plugin.load_checkpoint(path)["epoch"] == 5  # the checkpoint folder wins over the old file
        plugin.remove_checkpoint(path)  # both go: nothing of the old run resurfaces
        with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
            plugin.load_checkpoint(path)
