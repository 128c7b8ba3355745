"""The pieces under the Lightning plugin that need no Lightning: hyperparameter encoding, file replacement, the in-flight registry."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import os
import pathlib
import sys
import threading
import types

import pytest
import torch

import shardpoint as sp
from shardpoint.engine import inflight
from shardpoint.integrations import file_checkpoints
from shardpoint.integrations.hparams import TYPE_TAG, decode_plain, encode_plain


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Name(str, enum.Enum):
    A = "a"


Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass(frozen=True)
class Frozen:
    size: int
    where: pathlib.Path = pathlib.Path("w")
    derived: int = dataclasses.field(init=False, default=7)


@dataclasses.dataclass
class WithInitVar:
    a: int
    scale: dataclasses.InitVar[int] = 1


def round_trip(value, tmp_path, allow_pickle=False):
    path = str(tmp_path / "ck")
    sp.save(path, {"h": encode_plain(value, "h")}, allow_pickle=allow_pickle)
    return decode_plain(sp.load(path, {}, strict=False, allow_pickle=allow_pickle)["h"], allow_pickle)


def test_common_hyperparameter_types_round_trip_without_pickle(tmp_path):
    value = {
        "level": Level.HIGH, "name": Name.A, "pair": Pair(1, pathlib.Path("p")), "frozen": Frozen(3),
        "paths": [pathlib.Path("/a"), pathlib.PurePosixPath("b"), pathlib.PureWindowsPath("c:/d")],
        "device": torch.device("cuda", 2), "dtype": torch.bfloat16, "ns": argparse.Namespace(x=1, y=Level.LOW),
        "keyed": {Level.LOW: "low", "s": 1}, TYPE_TAG: "a user's key", "plain": (1, "two", None, 2.5),
    }
    back = round_trip(value, tmp_path)
    assert back == value
    assert type(back["level"]) is Level and back["name"] is Name.A and type(back["pair"]) is Pair
    assert type(back["paths"][0]) is type(pathlib.Path("/a")) and type(back["paths"][2]) is pathlib.PureWindowsPath
    assert back["frozen"].derived == 7 and back["keyed"][Level.LOW] == "low"


def test_values_not_handled_are_left_for_the_checkpoint_encoding(tmp_path):
    local = dataclasses.make_dataclass("Local", [("a", int)])  # not reachable by its name
    odd = [local(1), WithInitVar(2), object()]
    encoded = encode_plain(odd, "h")
    assert all(a is b for a, b in zip(encoded, odd))
    with pytest.raises(sp.UnsupportedStateError, match="pass allow_pickle=True"):
        sp.save(str(tmp_path / "ck"), {"h": encoded})
    untouched = {"w": torch.ones(2)}
    assert encode_plain(untouched, "h") is untouched  # nothing to change: the same object


def test_classes_are_found_only_in_modules_already_imported(tmp_path, monkeypatch):
    module = types.ModuleType("sp_not_imported_yet")
    exec("import enum\nclass Color(enum.Enum):\n    RED = 1\n", module.__dict__)
    module.Color.__module__ = "sp_not_imported_yet"
    monkeypatch.setitem(sys.modules, "sp_not_imported_yet", module)
    doc = encode_plain({"c": module.Color.RED}, "h")
    monkeypatch.delitem(sys.modules, "sp_not_imported_yet")
    with pytest.raises(sp.FormatError, match=r"sp_not_imported_yet.*not imported.*allow_pickle=True"):
        decode_plain(doc)
    with pytest.raises(sp.FormatError, match="cannot import module 'sp_not_imported_yet'"):
        decode_plain(doc, allow_pickle=True)  # with the opt-in it is imported, if it exists
    forged = {TYPE_TAG: "enum", "class": "os:path", "name": "sep"}  # names something that is not an Enum
    with pytest.raises(sp.FormatError, match="os:path is not an Enum"):
        decode_plain(forged)
    forged = {TYPE_TAG: "dataclass", "class": f"{__name__}:Frozen", "fields": {"size": 1}}
    with pytest.raises(sp.FormatError, match="now has fields"):
        decode_plain(forged)


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "move-aside"])
def test_replacing_a_file_by_a_checkpoint_folder(tmp_path, monkeypatch, atomic):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")
    if not atomic:  # a system without renameat2's exchange
        monkeypatch.setattr(file_checkpoints, "_exchange", lambda a, b: False)
    file_checkpoints.replace_file(str(target), lambda folder: sp.save(folder, {"x": torch.arange(4)}))
    assert target.is_dir() and os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(sp.load(str(target), {}, strict=False)["x"], torch.arange(4))


def test_a_failed_write_leaves_the_file(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")

    def fail(folder):
        sp.save(folder, {"x": torch.ones(1)})
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        file_checkpoints.replace_file(str(target), fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["last.ckpt"]


def test_the_registry_keys_paths_however_spelled_and_times_out(tmp_path):
    done = threading.Event()
    inflight.track_save(str(tmp_path / "a") + "/", done)
    assert inflight.saves_in_flight(f"file://{tmp_path}/./a") == 1
    assert inflight.wait_for_saves(str(tmp_path / "a"), timeout=0.05) is False
    done.set()
    assert inflight.wait_for_saves(str(tmp_path / "a"), timeout=0.05) is True
    assert inflight.saves_in_flight(str(tmp_path / "a")) == 0
    assert inflight.path_key("s3://b/p/") == "s3://b/p"


def test_a_load_right_after_an_async_save_sees_it_committed(tmp_path):
    path = str(tmp_path / "ck")
    w = torch.randn(4 << 20)
    handle = sp.async_save(path, {"w": w})
    got = sp.load(path, {}, strict=False)  # no wait() first: the load waits for the commit itself
    assert handle.done() and inflight.saves_in_flight(path) == 0
    assert torch.equal(got["w"], w)
    handle.wait()


def test_a_path_without_manifest_says_what_it_holds(tmp_path):
    torch.save({"a": 1}, tmp_path / "f.ckpt")
    with pytest.raises(sp.CheckpointNotFoundError, match="is a file, not a shardpoint checkpoint") as e:
        sp.load(str(tmp_path / "f.ckpt"), {}, strict=False)
    assert "interrupted" not in str(e.value)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    with pytest.raises(sp.CheckpointNotFoundError, match=r"not a shardpoint checkpoint.*\.metadata.*shardpoint import dcp") as e:
        sp.read_manifest(str(tmp_path / "dcp"))
    assert "interrupted" not in str(e.value)
