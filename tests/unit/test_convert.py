"""Converters without a process group: HF safetensors, DCP and torch.save both ways, reshard, diff."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardpoint as sp
from shardpoint.convert import (
    CheckpointReader,
    CheckpointWriter,
    ConversionError,
    diff,
    export_dcp,
    export_hf,
    export_torch,
    import_dcp,
    import_hf,
    import_torch,
    parse_layout,
    reshard,
)
from shardpoint.convert.options import parse_dtype, parse_rename, parse_size
from shardpoint.errors import UnsupportedStateError
from shardpoint.geometry import Box
from shardpoint.testing import GPTConfig, TinyGPT

CFG = GPTConfig(vocab=64, dim=16, heads=2, layers=2, seq=8)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture
def ckpt(tmp_path):
    """A saved TinyGPT with AdamW state and plain values; returns (path, model, optimizer)."""
    model, opt = _trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": model, "optimizer": opt, "extra": {"step": 7, "betas": (0.9, 0.95), "h": torch.tensor([1.5, -2.0])}})
    return path, model, opt


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------ parsing
def test_parse_helpers():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1048576") == 1 << 20
    assert parse_size("1.5KB") == 1500
    for bad in ("", "5XB", "-1", "0"):
        with pytest.raises(ConversionError):
            parse_size(bad)
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(None) is None and parse_dtype("keep") is None
    with pytest.raises(ConversionError, match="unknown dtype"):
        parse_dtype("fp7")
    (pat, rep), = parse_rename([r"^tok\.=embed_tokens."])
    assert pat.sub(rep, "tok.weight") == "embed_tokens.weight"
    with pytest.raises(ConversionError):
        parse_rename(["no-equals-sign"])


def test_parse_layout_specs():
    t = parse_layout("tp:2,fsdp:2", ["*.wo.weight=1", "*.bias=replicate"])
    assert t.world == 4 and t.spec() == "tp:2,fsdp:2"
    assert t.split_dim("tp", "x.wo.weight", 2) == 1
    assert t.split_dim("tp", "x.w1.bias", 1) is None
    assert t.split_dim("tp", "x.ln.weight", 1) is None  # 1-D without a rule: replicated
    assert t.split_dim("fsdp", "x.ln.weight", 1) == 0
    assert parse_layout("single").world == 1
    for bad in ("fsdp", "fsdp:0", "zero:2", "tp:x"):
        with pytest.raises(ConversionError, match="bad layout part"):
            parse_layout(bad)
    with pytest.raises(ConversionError):
        parse_layout("tp:2", ["*.w=dim1"])


# ------------------------------------------------------------------ hf
def test_export_hf_single_file(ckpt, tmp_path):
    path, model, _ = ckpt
    out = str(tmp_path / "hf")
    r = export_hf(path, out)
    assert r.files == ["model.safetensors"] and r.tensors == len(model.state_dict())
    got = load_file(os.path.join(out, "model.safetensors"))
    want = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(idx["weight_map"]) == set(want) and set(idx["weight_map"].values()) == {"model.safetensors"}
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())


def test_export_hf_shards_dtype_rename_keys(ckpt, tmp_path):
    path, model, _ = ckpt
    out = str(tmp_path / "hf")
    r = export_hf(path, out, dtype=torch.bfloat16, shard_size="3KB", rename=[r"^tok\.=embed_tokens."], keys=["model.tok.*", "model.layers.0.*"])
    assert len(r.files) > 1 and r.files[0] == f"model-00001-of-{len(r.files):05d}.safetensors"
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    names = set(idx["weight_map"])
    assert "embed_tokens.weight" in names and "layers.0.attn.wq.weight" in names
    assert not any(n.startswith(("layers.1.", "tok.", "head")) for n in names)
    got = {}
    for f in r.files:
        part = load_file(os.path.join(out, f))
        # a file holds one oversized tensor or stays under the cap
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 3000
        got.update(part)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["embed_tokens.weight"], model.tok.weight.detach().to(torch.bfloat16))


def test_export_hf_keeps_integer_tensors_and_refuses_collisions(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"model": {"w": torch.randn(3, 2), "idx": torch.arange(5), "mask": torch.tensor([True, False])}})
    out = str(tmp_path / "hf")
    export_hf(path, out, dtype=torch.float16)
    got = load_file(os.path.join(out, "model.safetensors"))
    assert got["w"].dtype == torch.float16 and got["idx"].dtype == torch.int64 and got["mask"].dtype == torch.bool
    with pytest.raises(ConversionError, match="both map to"):
        export_hf(path, str(tmp_path / "hf2"), rename=[".*=x"])
    with pytest.raises(ConversionError, match="no tensor matches prefix"):
        export_hf(path, str(tmp_path / "hf3"), prefix="decoder.")
    with pytest.raises(ConversionError, match="not empty"):
        export_hf(path, out)
    export_hf(path, out, force=True)


def _rss_peak_during(fn) -> tuple[int, int]:
    """(baseline RSS, peak RSS) in bytes while ``fn`` runs, sampled every millisecond."""
    import psutil

    import ctypes
    import gc

    gc.collect()
    try:  # hand freed heap pages back to the OS, so growth is measured from a true baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return base, peak[0]


def test_export_hf_streams_tensor_by_tensor(tmp_path):
    """48 tensors of 1 MiB: the export holds about one tensor at a time, never the model."""
    path = str(tmp_path / "big")
    n, rows = 48, 256  # 256 x 1024 float32 = 1 MiB each
    with CheckpointWriter(path) as w:  # written one tensor at a time: the test never holds them all
        for i in range(n):
            w.add(f"model.layers.{i}.weight", torch.full((rows, 1024), float(i)))
        w.commit()
    total = n * rows * 1024 * 4
    out = str(tmp_path / "hf")
    base, peak = _rss_peak_during(lambda: export_hf(path, out, shard_size="20MB"))
    assert peak - base < total / 4, f"export grew RSS by {(peak - base) / 2**20:.1f} MiB for a {total >> 20} MiB model"
    # the bf16 cast (one more copy per tensor) streams too
    base, peak = _rss_peak_during(lambda: export_hf(path, str(tmp_path / "hf16"), dtype=torch.bfloat16))
    assert peak - base < total / 4
    with safe_open(os.path.join(out, "model-00003-of-00003.safetensors"), "pt") as f:
        assert float(f.get_tensor("layers.47.weight")[0, 0]) == 47.0
    # The measurement does see tensors that are held: reading them all grows RSS by most of the model.
    reader = CheckpointReader(path)
    held: list = []
    base, peak = _rss_peak_during(lambda: held.extend(reader.read(name) for name in reader.names()))
    assert peak - base > total / 2
    del held


def test_import_hf_file_and_indexed_folder(ckpt, tmp_path):
    path, model, _ = ckpt
    single = str(tmp_path / "m.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, single)
    r = import_hf(single, str(tmp_path / "a"))
    assert r.tensors == len(model.state_dict())
    fresh = TinyGPT(CFG)
    sp.load(str(tmp_path / "a"), {"model": fresh})
    assert _same_state(fresh, model)
    # a sharded HF folder with an index, as export_hf writes it
    export_hf(path, str(tmp_path / "hf"), shard_size="4KB")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "b"))
    assert diff(path, str(tmp_path / "b"), keys=["model.*"]).same
    # it also loads into a plain dict: the HF state dict
    sd = sp.load(str(tmp_path / "b"), {"model": {}})["model"]
    assert sd.keys() == model.state_dict().keys()


def test_import_hf_prefix_rename_exclude_dtype(tmp_path):
    src = str(tmp_path / "x.safetensors")
    save_file({"transformer.w": torch.randn(4, 4), "transformer.position_ids": torch.arange(4)}, src)
    out = str(tmp_path / "ck")
    import_hf(src, out, prefix="net.", rename=[r"^transformer\.=body."], exclude=["*.position_ids"], dtype=torch.bfloat16)
    m = sp.read_manifest(out)
    assert sorted(m.tensors) == ["net.body.w"] and m.tensors["net.body.w"].dtype == "bfloat16"
    with pytest.raises(ConversionError, match="end with"):
        import_hf(src, str(tmp_path / "c"), prefix="net")
    with pytest.raises(ConversionError, match="no .safetensors"):
        os.makedirs(tmp_path / "empty")
        import_hf(str(tmp_path / "empty"), str(tmp_path / "d"))


# ------------------------------------------------------------------ dcp
def test_export_dcp_loads_with_dcp_without_process_group(ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    path, model, _ = ckpt
    out = str(tmp_path / "dcp")
    r = export_dcp(path, out)
    assert r.tensors == len(sp.read_manifest(path).tensors)
    fresh = TinyGPT(CFG)
    state = {"model": fresh.state_dict(), "extra": {"step": 0, "betas": (0.0, 0.0), "h": torch.zeros(2)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=out)
    fresh.load_state_dict(state["model"])
    assert _same_state(fresh, model)
    assert state["extra"]["step"] == 7 and state["extra"]["betas"] == (0.9, 0.95)
    assert torch.equal(state["extra"]["h"], torch.tensor([1.5, -2.0]))


def test_dcp_round_trip_keeps_everything(ckpt, tmp_path):
    path, model, opt = ckpt
    export_dcp(path, str(tmp_path / "dcp"))
    back = str(tmp_path / "back")
    import_dcp(str(tmp_path / "dcp"), back, allow_pickle=True)
    d = diff(path, back)
    assert d.same, d.to_json()
    m2 = TinyGPT(CFG)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    state = {"model": m2, "optimizer": o2, "extra": {}}
    sp.load(back, state)
    assert _same_state(m2, model)
    assert o2.param_groups[0]["lr"] == 1e-2
    assert torch.equal(o2.state[m2.tok.weight]["exp_avg"], opt.state[model.tok.weight]["exp_avg"])
    assert state["extra"]["step"] == 7


def test_import_dcp_needs_trust_and_skips_unstorable_objects(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _ = _trained(1)
    src = str(tmp_path / "dcp")
    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict(), "step": 5, "sched": {"milestones": [1, 2]}, "ns": argparse.Namespace(a=1)}, checkpoint_id=src)
    with pytest.raises(ConversionError, match="pickle"):
        import_dcp(src, str(tmp_path / "x"))
    out = str(tmp_path / "ck")
    r = import_dcp(src, out, allow_pickle=True)
    assert any(s.startswith("ns") for s in r.skipped)
    state = {"model": TinyGPT(CFG), "step": 0, "sched": {}}
    sp.load(out, state)
    assert _same_state(state["model"], model) and state["step"] == 5 and state["sched"] == {"milestones": [1, 2]}
    with pytest.raises(ConversionError, match="not a DCP folder"):
        import_dcp(str(tmp_path), str(tmp_path / "y"), allow_pickle=True)


def test_import_dcp_bare_state_dict_with_prefix(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _ = _trained(2)
    src = str(tmp_path / "dcp")
    with pytest.warns(UserWarning):
        dcp.save(model.state_dict(), checkpoint_id=src)
    out = str(tmp_path / "ck")
    import_dcp(src, out, allow_pickle=True, prefix="model.")
    fresh = TinyGPT(CFG)
    sp.load(out, {"model": fresh})
    assert _same_state(fresh, model)


# ------------------------------------------------------------------ torch.save
def test_export_torch_is_a_plain_state_dict(ckpt, tmp_path):
    path, model, _ = ckpt
    out = str(tmp_path / "m.pt")
    export_torch(path, out)
    sd = torch.load(out, weights_only=True)
    fresh = TinyGPT(CFG)
    fresh.load_state_dict(sd)
    assert _same_state(fresh, model)
    export_torch(path, str(tmp_path / "all.pt"), prefix="", dtype=torch.bfloat16)
    everything = torch.load(str(tmp_path / "all.pt"), weights_only=True)
    assert "optimizer.state.model.tok.weight.exp_avg" in everything and "extra.h" in everything
    assert everything["model.tok.weight"].dtype == torch.bfloat16
    with pytest.raises(ConversionError, match="exists"):
        export_torch(path, out)
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path))


def test_import_torch_needs_trust_and_keeps_structure(tmp_path):
    model, opt = _trained(3)
    src = str(tmp_path / "train.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "args": argparse.Namespace(lr=1)}, src)
    with pytest.raises(ConversionError, match="allow_pickle"):
        import_torch(src, str(tmp_path / "x"))
    out = str(tmp_path / "ck")
    r = import_torch(src, out, allow_pickle=True, prefix="")
    assert any(s.startswith("args") for s in r.skipped)
    state = {"model": TinyGPT(CFG), "optimizer": {}, "epoch": 0}
    sp.load(out, state)
    assert _same_state(state["model"], model) and state["epoch"] == 3
    osd = state["optimizer"]
    assert osd["param_groups"][0]["lr"] == 1e-2
    assert torch.equal(osd["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # the optimizer state dict can go straight back into an optimizer
    o2 = torch.optim.AdamW(state["model"].parameters())
    o2.load_state_dict(osd)


def test_import_torch_plain_and_legacy_files(tmp_path):
    model, _ = _trained(4)
    legacy = str(tmp_path / "legacy.pt")
    torch.save(model.state_dict(), legacy, _use_new_zipfile_serialization=False)
    out = str(tmp_path / "ck")
    import_torch(legacy, out, allow_pickle=True)
    fresh = TinyGPT(CFG)
    sp.load(out, {"model": fresh})
    assert _same_state(fresh, model)
    whole = str(tmp_path / "module.pt")
    torch.save(model, whole)  # a pickled module contributes its state_dict
    import_torch(whole, str(tmp_path / "ck2"), allow_pickle=True, rename=[r"^tok\.=embed."])
    assert "model.embed.weight" in sp.read_manifest(str(tmp_path / "ck2")).tensors
    torch.save(torch.ones(3), str(tmp_path / "t.pt"))
    with pytest.raises(ConversionError, match="not a dict"):
        import_torch(str(tmp_path / "t.pt"), str(tmp_path / "ck3"), allow_pickle=True, prefix="")


# ------------------------------------------------------------------ reshard
def test_reshard_fsdp_chunks_follow_torch_chunk(ckpt, tmp_path):
    path, model, opt = ckpt
    out = str(tmp_path / "r4")
    r = reshard(path, out, "fsdp:4")
    m = sp.read_manifest(out)
    assert m.world_size == 4 and m.layout["offline_layout"] == "fsdp:4" and r.world == 4
    w = m.tensors["model.layers.0.mlp.w1.weight"]  # 64 rows -> 4 x 16
    assert [(c.rank, c.box.offsets[0], c.box.sizes[0]) for c in w.chunks] == [(0, 0, 16), (1, 16, 16), (2, 32, 16), (3, 48, 16)]
    tok = m.tensors["model.pos.weight"]  # 8 rows -> chunks of 2
    assert [c.box.sizes[0] for c in tok.chunks] == [2, 2, 2, 2]
    step = m.tensors["optimizer.state.model.tok.weight.step"]  # 0-d: one chunk
    assert len(step.chunks) == 1
    assert diff(path, out).same
    m2 = TinyGPT(CFG)
    o2 = torch.optim.AdamW(m2.parameters())
    state = {"model": m2, "optimizer": o2, "extra": {}}
    sp.load(out, state)
    assert _same_state(m2, model) and state["extra"]["step"] == 7
    assert torch.equal(o2.state[m2.tok.weight]["exp_avg_sq"], opt.state[model.tok.weight]["exp_avg_sq"])


def test_reshard_uneven_tp_rules_and_replicas(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"model": {"a": torch.randn(5, 6), "b": torch.randn(6, 5), "bias": torch.randn(5), "s": torch.tensor(3.0)}})
    out = str(tmp_path / "r")
    reshard(path, out, "dp:2,tp:3", tp_rules=["*.b=1"])
    m = sp.read_manifest(out)
    assert m.world_size == 6
    a = m.tensors["model.a"].chunks  # dim 0 of 5 rows over 3: 2, 2, 1
    assert [c.box.sizes for c in a] == [(2, 6), (2, 6), (1, 6)]
    b = m.tensors["model.b"].chunks  # dim 1 of 5 columns over 3
    assert [c.box.offsets for c in b] == [(0, 0), (0, 2), (0, 4)]
    bias = m.tensors["model.bias"].chunks  # 1-D: replicated over dp and tp, written once
    assert len(bias) == 1
    # replicated pieces go to the least loaded writers: dp replicas share the work
    ranks_a = {c.rank for c in a}
    assert ranks_a <= set(range(6)) and len({c.rank for t in m.tensors.values() for c in t.chunks}) > 3
    assert diff(path, out).same
    with pytest.raises(ConversionError, match="only 1 dims"):
        reshard(path, str(tmp_path / "bad"), "tp:2", tp_rules=["*=1"])


# ------------------------------------------------------------------ diff
def test_diff_reports_changes_with_tolerances(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = {"w": torch.arange(6.0).view(2, 3), "n": torch.tensor([float("nan"), 1.0]), "i": torch.arange(3), "s": torch.ones(4)}
    sp.save(a, {"model": dict(base), "extra": {"step": 1}})
    changed = dict(base, w=base["w"] + torch.tensor([[0, 0, 1e-3], [0, 0, 0]]), i=torch.tensor([0, 1, 5]), s=torch.ones(5))
    changed["only_b"] = torch.zeros(1)
    sp.save(b, {"model": changed, "extra": {"step": 2}})
    d = diff(a, b)
    assert not d.same
    by = {t.name: t for t in d.changed}
    assert set(by) == {"model.w", "model.i", "model.s"}  # NaNs in the same places are equal
    assert by["model.w"].n_diff == 1 and by["model.w"].max_abs == pytest.approx(1e-3, rel=1e-3)
    assert by["model.w"].max_rel == pytest.approx(1e-3 / 2.001, rel=1e-3)
    assert by["model.i"].max_abs == 3 and by["model.s"].reason.startswith("shape")
    assert d.only_b == ["model.only_b"] and d.values_changed == ["extra"]
    d = diff(a, b, atol=1e-2, keys=["model.w", "model.n"])
    assert d.same and d.compared == 2


def test_diff_reads_large_tensors_in_row_blocks(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    w = torch.randn(64, 32)
    sp.save(a, {"w": w})
    w2 = w.clone()
    w2[50, 3] += 1
    sp.save(b, {"w": w2})
    r = CheckpointReader(a)
    assert len(list(r.row_blocks("w", max_bytes=1024))) == 8
    d = diff(a, b, block_bytes=1024)
    assert d.changed[0].n_diff == 1 and d.changed[0].max_abs == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------ writer
def test_writer_checks_coverage_dtype_and_commits_atomically(tmp_path):
    out = str(tmp_path / "w")
    with pytest.raises(ConversionError, match="cover 4 of 8"):
        with CheckpointWriter(out) as w:
            w.add("t", torch.ones(2, 2), shape=(4, 2), box=Box((0, 0), (2, 2)))
            w.commit()
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    with pytest.raises(UnsupportedStateError, match="--dtype"):
        with CheckpointWriter(out) as w:
            w.add("t", torch.ones(2, dtype=torch.uint16))
    with CheckpointWriter(out, block_size=64) as w:
        w.add("t", torch.arange(8.0).view(4, 2)[:2], shape=(4, 2), box=Box((0, 0), (2, 2)), rank=0)
        w.add("t", torch.arange(8.0).view(4, 2)[2:], shape=(4, 2), box=Box((2, 0), (2, 2)), rank=3)
        w.set_value("extra", {"k": 1})
        m = w.commit()
    assert m.world_size == 4 and sorted(m.values) == ["extra", "t"]
    assert torch.equal(sp.read_tensor(out, "t"), torch.arange(8.0).view(4, 2))
    assert sp.load(out, {"t": None, "extra": {}})["extra"] == {"k": 1}
