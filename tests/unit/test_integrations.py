"""shardpoint.integrations without any framework: optional imports, key discovery, removal."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.runtime.extras import require
from shardpoint.integrations.common import remove_path, top_level_keys


def test_require_names_the_package_and_the_command():
    with pytest.raises(sp.MissingDependencyError, match=r"pip install no-such-framework") as e:
        require("no_such_framework_mod", "", "shardpoint.integrations.x", "pip install no-such-framework", package="no-such-framework")
    assert isinstance(e.value, ImportError) and isinstance(e.value, sp.CheckpointError)
    assert e.value.package == "no-such-framework" and e.value.hint == "pip install no-such-framework"


def test_top_level_keys_come_from_values_and_tensors(tmp_path):
    path = str(tmp_path / "c")
    sp.save(path, {"epoch": 3, "state_dict": {"w": torch.ones(2)}, "t": torch.zeros(1), "cfg": {"a": 1}})
    assert sorted(top_level_keys(sp.read_manifest(path))) == ["cfg", "epoch", "state_dict", "t"]


def test_remove_path_removes_folders_and_files(tmp_path):
    folder = tmp_path / "ck.ckpt"
    sp.save(str(folder), {"w": torch.ones(3)})
    remove_path(str(folder))
    assert not folder.exists()
    single = tmp_path / "old.ckpt"
    single.write_bytes(b"x")  # a checkpoint from another CheckpointIO: one file
    remove_path(str(single))
    assert not single.exists()
    remove_path(str(tmp_path / "absent"))  # nothing to do
