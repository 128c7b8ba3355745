"""The core installs without the corner packages; each missing one gives a typed error naming its extra."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.cli import main
from shardpoint.convert import export_hf, import_hf
from shardpoint.errors import CheckpointError, MissingDependencyError, StorageError
from shardpoint.runtime.extras import EXTRAS, require
from shardpoint.storage import MissingDependencyError as StorageMissingDependencyError


def _hide(monkeypatch, *names: str) -> None:
    """Make ``import name`` fail as if the package were not installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, name)
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    sp.save(path, {"model": torch.nn.Linear(4, 3)})
    return path


def test_shardpoint_imports_and_saves_without_the_optional_packages(tmp_path):
    code = (
        "import sys\n"
        "for m in ('rich', 'tqdm', 'safetensors', 'matplotlib', 'boto3'): sys.modules[m] = None\n"
        "import torch, shardpoint as sp, shardpoint.cli, shardpoint.convert, shardpoint.storage\n"
        "m = torch.nn.Linear(4, 3)\n"
        f"sp.save({str(tmp_path / 'c')!r}, {{'model': m}})\n"
        "n = torch.nn.Linear(4, 3)\n"
        f"sp.load({str(tmp_path / 'c')!r}, {{'model': n}})\n"
        "print(torch.equal(m.weight, n.weight))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_require_names_the_extra(monkeypatch):
    _hide(monkeypatch, "tqdm")
    with pytest.raises(MissingDependencyError, match=r"progress bars needs the package 'tqdm'.*pip install 'shardpoint\[cli\]'"):
        require("tqdm", "cli", "progress bars")
    assert issubclass(MissingDependencyError, CheckpointError) and issubclass(MissingDependencyError, ImportError)
    assert issubclass(StorageMissingDependencyError, MissingDependencyError)
    assert issubclass(StorageMissingDependencyError, StorageError)
    assert EXTRAS["hf"] == ("safetensors",) and set(EXTRAS) == {"cli", "hf", "s3", "plot"}


def test_cli_without_rich_and_tqdm(monkeypatch, ckpt, tmp_path, capsys):
    _hide(monkeypatch, "rich", "tqdm")
    assert main(["inspect", ckpt]) == 2
    assert "pip install 'shardpoint[cli]'" in capsys.readouterr().err
    assert main(["inspect", ckpt, "--json"]) == 0  # machine output needs no table library
    assert main(["verify", ckpt, "--quiet"]) == 0  # quiet: no progress bar, no tqdm
    assert main(["verify", ckpt]) == 2
    assert "progress bars needs the package 'tqdm'" in capsys.readouterr().err
    r = export_hf(ckpt, str(tmp_path / "hf"))  # the Python API is quiet by default
    assert r.tensors == 2


def test_hf_import_and_plot_without_their_packages(monkeypatch, ckpt, tmp_path):
    export_hf(ckpt, str(tmp_path / "hf"))
    _hide(monkeypatch, "safetensors", "matplotlib")
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardpoint\[hf\]'"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    from shardpoint.convert.shardmap import plot_shard_map

    with pytest.raises(MissingDependencyError, match=r"shard map plots .*pip install 'shardpoint\[plot\]'"):
        plot_shard_map(sp.read_manifest(ckpt), str(tmp_path / "map.png"))
