"""The torch compatibility layer: version checks live in one module, and old-torch paths work on any torch.

Each shim's old-torch path is forced here (by patching the module's feature
detection), so both of its paths run whichever torch the suite runs on.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardpoint
from shardpoint.errors import UnsupportedStateError
from shardpoint.runtime import torchcompat

PKG = pathlib.Path(shardpoint.__file__).resolve().parent
COMPAT = "runtime/torchcompat.py"

# Reading or comparing torch's version, in code: only the compatibility module may.
VERSION_CHECK = re.compile(
    r"torch\.__version__|torch\.version\b|TorchVersion|\bTORCH_VERSION\b|\bMIN_TORCH\b"
    r"|packaging\.version|parse_version|LooseVersion|version\(\s*[\"']torch[\"']\s*\)"
)


def version_checks(root: pathlib.Path = PKG) -> list[str]:
    """``path:line: match`` for every torch version check outside the compatibility module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == COMPAT:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            found.extend(f"{rel}:{i}: {m.group(0)}" for m in VERSION_CHECK.finditer(code))
    return found


def test_torch_version_checks_live_only_in_torchcompat():
    assert (PKG / COMPAT).exists()
    assert version_checks() == []


def test_the_version_scan_finds_a_planted_check(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "runtime" / "torchcompat.py").write_text("import torch\nV = torch.__version__\n")
    (pkg / "saving").mkdir()
    (pkg / "saving" / "bad.py").write_text(
        "import torch\n"
        "# torch.__version__ in a comment is prose\n"
        "if torch.__version__ >= '2.7':\n"
        "    pass\n"
        "from packaging.version import Version\n"
        "from shardpoint.runtime.torchcompat import TORCH_VERSION\n"
        "old = importlib.metadata.version('torch')\n"
    )
    assert version_checks(pkg) == [
        "saving/bad.py:3: torch.__version__",
        "saving/bad.py:5: packaging.version",
        "saving/bad.py:6: TORCH_VERSION",
        "saving/bad.py:7: version('torch')",
    ]


def test_the_installed_release_is_read_and_supported():
    assert torchcompat.TORCH_VERSION == tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert torchcompat.TORCH_VERSION >= torchcompat.MIN_TORCH == (2, 6)


def test_require_names_the_release_needed_and_the_one_installed():
    torchcompat.require("anything", True, "9.9")  # available: no error
    with pytest.raises(UnsupportedStateError) as e:
        torchcompat.require("Zero-copy staging", False, "9.9")
    msg = str(e.value)
    assert "Zero-copy staging needs torch 9.9 or later" in msg
    assert f"this is torch {torch.__version__}" in msg and "pip install 'torch>=9.9'" in msg


# --- strided shards ----------------------------------------------------------------------------------

FSDP2_TP = (_StridedShard(0, split_factor=2), Shard(0))  # 2-D FSDP2 + TP on a (dp, tp) mesh


@pytest.fixture(params=["this torch", "old torch"])
def torch_offsets(request, monkeypatch):
    """Run a test as is, and again as if torch's strided offsets were 2.6's."""
    if request.param == "old torch":
        monkeypatch.setattr(torchcompat, "torch_places_uneven_strided_shards", lambda: False)
    return request.param


def test_uneven_fsdp2_tp_shards_sit_where_fsdp2_puts_them(torch_offsets):
    # 52 rows, tp=2 -> 26 per tp rank; dp=3 chunks them 9, 9, 8.
    got = [torchcompat.local_shape_and_offset((52, 16), (3, 2), (d, t), FSDP2_TP) for d in range(3) for t in range(2)]
    assert got == [
        ((9, 16), (0, 0)), ((9, 16), (26, 0)),
        ((9, 16), (9, 0)), ((9, 16), (35, 0)),
        ((8, 16), (18, 0)), ((8, 16), (44, 0)),
    ]


def test_even_and_plain_shards_are_torchs(torch_offsets):
    assert torchcompat.local_shape_and_offset((8, 4), (2, 2), (1, 1), FSDP2_TP) == ((2, 4), (6, 0))
    assert torchcompat.local_shape_and_offset((8, 4), (2,), [1], [Shard(0)]) == ((4, 4), (4, 0))
    assert torchcompat.local_shape_and_offset((5, 7), (3, 2), (2, 1), (Shard(1), Shard(0))) == ((2, 1), (3, 6))
    assert torchcompat.local_shape_and_offset((3, 2), (2, 4), (1, 3), (Replicate(), Shard(0))) == ((0, 2), (3, 0))


def test_empty_shards_sit_at_the_dims_size(torch_offsets):
    # 3 rows over 2 x 4 ranks: the first half [0, 2) leaves its last two quarters empty.
    assert torchcompat.local_shape_and_offset((3,), (2, 4), (0, 3), (Shard(0), Shard(0))) == ((0,), (3,))


def test_a_strided_split_fsdp2_never_makes_needs_a_newer_torch_when_uneven(monkeypatch):
    monkeypatch.setattr(torchcompat, "torch_places_uneven_strided_shards", lambda: False)
    odd = (_StridedShard(0, split_factor=3), Shard(0))  # not the later mesh dims' size: no nested model
    with pytest.raises(UnsupportedStateError) as e:
        torchcompat.local_shape_and_offset((7, 2), (2, 2), (0, 1), odd)
    assert "needs torch 2.8 or later" in str(e.value) and torch.__version__ in str(e.value)
    # evenly split, torch's own arithmetic is right on every release
    assert torchcompat.local_shape_and_offset((12, 2), (2, 2), (0, 0), odd)[0] == (3, 2)
    # a strided tensor with another dim split unevenly: FSDP2's split, torch 2.6 misplaces dim 1
    assert torchcompat.local_shape_and_offset((1, 3), (1, 2), (0, 1), (_StridedShard(0, split_factor=1), Shard(1))) == ((1, 1), (0, 2))


# --- streams, DCP ------------------------------------------------------------------------------------


def test_cpu_fsdp2_is_enabled_only_where_torch_lacks_it(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    class Stub:  # torch 2.6's torch.cpu.Stream
        def wait_stream(self, stream):
            pass

    monkeypatch.setattr(torch.cpu, "Stream", Stub)
    # restored after the test, whatever enable_cpu_fsdp2 puts there
    for mod in (_fsdp_collectives, _fsdp_param_group):
        monkeypatch.setattr(mod, "foreach_all_gather_copy_out", mod.foreach_all_gather_copy_out)
    monkeypatch.setattr(_fsdp_collectives, "_get_gradient_divide_factors", _fsdp_collectives._get_gradient_divide_factors)
    assert torchcompat.enable_cpu_fsdp2() is True
    ev = Stub().record_event()
    assert isinstance(ev, torch.cpu.Event) and ev.query()
    assert Stub().wait_event(ev) is None
    wrapped = _fsdp_collectives.foreach_all_gather_copy_out
    assert _fsdp_param_group.foreach_all_gather_copy_out is wrapped
    assert torchcompat.enable_cpu_fsdp2() is False  # already there: nothing replaced again
    assert _fsdp_collectives.foreach_all_gather_copy_out is wrapped


def test_a_regather_keeps_the_version_autograd_saw():
    class Param:
        all_gather_outputs = [torch.zeros(4), torch.zeros(2)]

    def copy_out(result, params, group):  # what FSDP2's copy does: write into the gathered buffers
        for t in params[0].all_gather_outputs:
            t.add_(result)

    p = Param()
    versions = [t._version for t in p.all_gather_outputs]
    torchcompat._keeping_versions(copy_out)(1.0, [p], None)
    assert [t._version for t in p.all_gather_outputs] == versions
    assert torch.equal(p.all_gather_outputs[0], torch.ones(4))  # the values did change


@pytest.mark.parametrize("way", ["this torch", "state_dict functions"])
def test_single_process_dcp_round_trips(tmp_path, monkeypatch, way):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if way != "this torch":  # torch 2.6's way, which later releases still offer
        monkeypatch.setattr(torchcompat, "_dcp_takes_no_dist", lambda: False)
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, 2], dtype=torch.int64)}
    torchcompat.dcp_save_local(state, FileSystemWriter(str(tmp_path)))
    back = {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.int64)}
    torchcompat.dcp_load_local(back, FileSystemReader(str(tmp_path)))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
