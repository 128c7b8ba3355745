"""Incremental saves (``base=``): what is referenced, what is written, and loads through references."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as hst

import shardpoint as sp
from shardpoint.errors import CorruptCheckpointError, FormatError, MissingBaseError, UnsupportedStateError
from shardpoint.format.refs import RefFiles, check_base, join_base, parse_refs
from shardpoint.storage import MemoryStorage
from tests.unit.incremental_states import data_bytes, lora_pair

BLOCK = 1 << 12


def _load(path):
    return sp.load(path, {}, strict=False)


# --- pure reference logic -------------------------------------------------------------------------

def test_check_base_accepts_relative_sibling_locations_only():
    assert check_base("../step_1") == "../step_1"
    assert check_base("../../other/step_1") == "../../other/step_1"
    assert check_base(".") == "."
    for bad in ("step_1", "/abs/step_1", "../a/../b", "..", "../", "../a//b", "../.", ""):
        with pytest.raises(FormatError, match="malformed base location"):
            check_base(bad)


@settings(max_examples=60, deadline=None)
@given(hst.integers(1, 3), hst.lists(hst.sampled_from(["a", "b", "step_1"]), min_size=1, max_size=3),
       hst.lists(hst.sampled_from(["c", "step_2"]), min_size=1, max_size=2))
def test_join_base_resolves_to_the_holder(ups, to_prev_parts, ref_parts):
    import posixpath

    to_prev = "/".join([".."] * ups + to_prev_parts)
    prev_ref = "/".join([".."] + ref_parts)
    try:
        got = join_base(to_prev, prev_ref)
    except FormatError:
        return  # the holder would lie inside the new checkpoint: not a base
    # Resolving from a fixed folder gives the same place as going through prev.
    here = "/r/s/t/new"
    direct = posixpath.normpath(posixpath.join(here, got))
    via = posixpath.normpath(posixpath.join(posixpath.normpath(posixpath.join(here, to_prev)), prev_ref))
    assert direct == via


def test_parse_refs_rejects_unlisted_index_and_bad_names():
    good = [0, "../s1", "data/ab12cd34-r00000.bin", 64, "data/x-r00000-ref0.idx", "0" * 32]
    refs = parse_refs([good], {"data/x-r00000-ref0.idx": 80}, 1, "ckpt")
    assert refs == (RefFiles(0, "../s1", "data/ab12cd34-r00000.bin", 64, "data/x-r00000-ref0.idx", "0" * 32),)
    with pytest.raises(FormatError, match="unlisted index file"):
        parse_refs([good], {}, 1, "ckpt")
    with pytest.raises(FormatError, match="not a data file name"):
        parse_refs([[0, "../s1", "../../etc/passwd", 64, "data/x-r00000-ref0.idx", "0" * 32]], {"data/x-r00000-ref0.idx": 1}, 1, "c")
    with pytest.raises(FormatError, match="not a rank"):
        parse_refs([[3, *good[1:]]], {"data/x-r00000-ref0.idx": 1}, 1, "ckpt")


# --- saves and loads on local disk ----------------------------------------------------------------

def test_without_base_the_format_is_unchanged(tmp_path):
    sp.save(str(tmp_path / "a"), lora_pair(), block_size=BLOCK)
    doc = json.loads((tmp_path / "a" / "manifest.json").read_bytes())
    assert doc["format_version"] == 3 and "refs" not in doc


def test_unchanged_chunks_are_referenced_and_changed_ones_written(tmp_path):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["adapter"].add_(1)
    r = sp.save(b, st, block_size=BLOCK, base=a)
    adapter_bytes = st["model"]["adapter"].numel() * 4
    assert data_bytes(b) == adapter_bytes  # only the adapter
    assert r.bytes_referenced == st["model"]["frozen"].numel() * 4
    doc = json.loads((tmp_path / "b" / "manifest.json").read_bytes())
    assert doc["format_version"] == 4 and {e[1] for e in doc["refs"]} == {"../a"}
    out = _load(b)
    assert torch.equal(out["model"]["frozen"], st["model"]["frozen"])
    assert torch.equal(out["model"]["adapter"], st["model"]["adapter"])
    assert sp.references_outside(b) == {"../a": {doc["refs"][0][2]: data_bytes(a)}}


def test_a_frozen_tensor_that_changed_is_written(tmp_path):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["frozen"].requires_grad_(False)[3, 5] += 1.0  # "frozen", but changed by one element
    sp.save(b, st, block_size=BLOCK, base=a)
    assert data_bytes(b) >= st["model"]["frozen"].numel() * 4
    assert torch.equal(_load(b)["model"]["frozen"], st["model"]["frozen"])


def test_another_block_size_or_shape_is_written_in_full(tmp_path):
    st = lora_pair()
    a, b, c = (str(tmp_path / n) for n in "abc")
    sp.save(a, st, block_size=BLOCK)
    sp.save(b, st, block_size=BLOCK * 2, base=a)
    assert "refs" not in json.loads((tmp_path / "b" / "manifest.json").read_bytes())
    st["model"]["frozen"] = st["model"]["frozen"].reshape(128, 128)
    sp.save(c, st, block_size=BLOCK, base=a)
    assert data_bytes(c) >= 256 * 64 * 4  # the reshaped tensor: nothing at the same place
    assert torch.equal(_load(c)["model"]["frozen"], st["model"]["frozen"])


def test_chains_are_flat_and_survive_removing_the_middle(tmp_path):
    st = lora_pair()
    a, b, c = (str(tmp_path / n) for n in "abc")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["adapter"].add_(1)
    sp.save(b, st, block_size=BLOCK, base=a)
    st["model"]["adapter"].add_(1)
    sp.save(c, st, block_size=BLOCK, base=b)
    bases = {e[1] for e in json.loads((tmp_path / "c" / "manifest.json").read_bytes())["refs"]}
    assert bases == {"../a"}  # the holder, never the intermediate checkpoint
    shutil.rmtree(b)
    out = _load(c)
    assert torch.equal(out["model"]["frozen"], st["model"]["frozen"]) and torch.equal(out["model"]["adapter"], st["model"]["adapter"])


def test_a_removed_base_fails_before_loading_anything_and_names_it(tmp_path):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    sp.save(b, st, block_size=BLOCK, base=a)
    shutil.rmtree(a)
    target = {"model": {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(8, 8)}, "step": 0}
    with pytest.raises(MissingBaseError, match=r"\.\./a") as ei:
        sp.load(b, target)
    assert ei.value.base == "../a" and isinstance(ei.value, sp.CheckpointError)
    assert target["step"] == 0 and not target["model"]["adapter"].any()  # nothing partial
    with pytest.raises(MissingBaseError):
        sp.consolidate(b, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_damaged_shared_block_fails_every_load_that_reads_it(tmp_path):
    st = lora_pair()
    a, b, c = (str(tmp_path / n) for n in "abc")
    sp.save(a, st, block_size=BLOCK)
    sp.save(b, st, block_size=BLOCK, base=a)
    sp.save(c, st, block_size=BLOCK, base=b)
    (data,) = [n for n in os.listdir(os.path.join(a, "data")) if n.endswith(".bin")]
    with open(os.path.join(a, "data", data), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    for path in (a, b, c):
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            _load(path)
        with pytest.raises(CorruptCheckpointError):
            sp.read_tensor(path, "model.frozen")


def test_base_elsewhere_is_refused(tmp_path):
    st = lora_pair()
    sp.save(str(tmp_path / "a"), st, block_size=BLOCK)
    with pytest.raises(UnsupportedStateError, match="same storage"):
        sp.save(MemoryStorage().child("b"), st, base=str(tmp_path / "a"))
    saver = sp.AsyncSaver(prewarm=False)
    try:  # a background save opens its base on the writer: the refusal comes at wait()
        h = saver.save(MemoryStorage().child("b"), st, base=str(tmp_path / "a"))
        with pytest.raises(UnsupportedStateError, match="same storage"):
            h.wait()
    finally:
        saver.close()


def test_consolidate_makes_a_self_contained_copy_and_exports_read_through(tmp_path):
    from shardpoint.convert.torchfile import export_torch
    from shardpoint.convert.verify import verify_checkpoint

    st = lora_pair()
    a, b, out = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["adapter"].mul_(2)
    sp.save(b, st, block_size=BLOCK, base=a)
    export_torch(b, str(tmp_path / "model.pt"), prefix="model.")
    exported = torch.load(str(tmp_path / "model.pt"))
    assert torch.equal(exported["frozen"], st["model"]["frozen"]) and torch.equal(exported["adapter"], st["model"]["adapter"])
    sp.consolidate(b, out)
    assert sp.references_outside(out) == {}
    shutil.rmtree(a)
    got = _load(out)
    assert torch.equal(got["model"]["frozen"], st["model"]["frozen"])
    assert verify_checkpoint(out)[1] == []


# --- in memory --------------------------------------------------------------------------------------

def test_memory_storage_references_siblings():
    run = MemoryStorage()
    st = lora_pair()
    sp.save(run.child("s1"), st, block_size=BLOCK)
    st["model"]["adapter"].add_(3)
    r = sp.save(run.child("s2"), st, block_size=BLOCK, base=run.child("s1"))
    assert r.bytes_written < 1024 and r.bytes_referenced == 256 * 64 * 4
    out = _load(run.child("s2"))
    assert torch.equal(out["model"]["frozen"], st["model"]["frozen"]) and torch.equal(out["model"]["adapter"], st["model"]["adapter"])
    for name in run.child("s1").list(""):
        run.child("s1").delete(name)
    with pytest.raises(MissingBaseError, match="s1"):
        _load(run.child("s2"))


def test_hf_and_dcp_exports_read_through_references(tmp_path):
    import glob

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from shardpoint.convert import export_dcp, export_hf

    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["adapter"].sub_(1)
    sp.save(b, st, block_size=BLOCK, base=a)
    assert sp.references_outside(b)
    export_hf(b, str(tmp_path / "hf"), prefix="model.")
    got = {}
    for f in glob.glob(str(tmp_path / "hf" / "*.safetensors")):
        got.update(load_file(f))
    assert torch.equal(got["frozen"], st["model"]["frozen"]) and torch.equal(got["adapter"], st["model"]["adapter"])
    export_dcp(b, str(tmp_path / "dcp"))
    back = {"model.frozen": torch.zeros(256, 64), "model.adapter": torch.zeros(8, 8)}
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(back["model.frozen"], st["model"]["frozen"]) and torch.equal(back["model.adapter"], st["model"]["adapter"])


def test_a_base_at_the_saved_path_itself_is_refused(tmp_path):
    st = lora_pair()
    a = str(tmp_path / "a")
    sp.save(a, st, block_size=BLOCK)
    with pytest.raises(UnsupportedStateError, match="cannot be referenced"):
        sp.save(a, st, block_size=BLOCK, base=a)
    assert torch.equal(_load(a)["model"]["frozen"], st["model"]["frozen"])


@settings(max_examples=15, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(1, 40), hst.booleans()), min_size=1, max_size=6), hst.sampled_from([16, 64, 256]))
def test_exactly_the_unchanged_chunks_are_referenced(specs, block):
    run = MemoryStorage()
    g = torch.Generator().manual_seed(len(specs))
    state = {f"t{i}": torch.randn(n, generator=g) for i, (n, _) in enumerate(specs)}
    sp.save(run.child("a"), state, block_size=block)
    for i, (n, change) in enumerate(specs):
        if change:
            state[f"t{i}"][n // 2] += 1.0
    r = sp.save(run.child("b"), state, block_size=block, base=run.child("a"))
    assert r.bytes_referenced == sum(n * 4 for n, change in specs if not change)
    out = sp.load(run.child("b"), {}, strict=False)
    assert all(torch.equal(out[k], v) for k, v in state.items())
