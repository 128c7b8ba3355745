"""The layout language: fused (GQA) QKV and padded vocabularies stored as logical tensors."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.items import SaveTensor
from shardpoint.geometry import Box
from shardpoint.layouts import Fused, Padded, apply_save
from shardpoint.testing import GPTConfig, TinyGPT, train_step

BASE = dict(vocab=50, dim=32, heads=8, kv_heads=2, layers=2, seq=8)


def _unfuse(fused: TinyGPT, c: GPTConfig) -> dict[str, torch.Tensor]:
    """The unfused state of a fused model, computed independently of shardpoint."""
    hd, g = c.dim // c.heads, c.heads // c.kv
    out = {}
    for k, v in fused.state_dict().items():
        if k.endswith("attn.wqkv.weight"):
            grp = v.view(c.kv, g + 2, hd, c.dim)
            base = k[: -len("wqkv.weight")]
            out[base + "wq.weight"] = grp[:, :g].reshape(c.kv * g * hd, c.dim)
            out[base + "wk.weight"] = grp[:, g].reshape(c.kv * hd, c.dim)
            out[base + "wv.weight"] = grp[:, g + 1].reshape(c.kv * hd, c.dim)
        else:
            out[k] = v
    return out


def test_segments_and_names():
    r = Fused("*.attn.wqkv.weight", dim=0, groups=2, parts=[("wq", 4), ("wk", 2), ("wv", 2)])
    assert [(s.start, s.length, s.name, s.logical_start) for s in r.segments(16)] == [
        (0, 4, "wq", 0), (4, 2, "wk", 0), (6, 2, "wv", 0), (8, 4, "wq", 4), (12, 2, "wk", 2), (14, 2, "wv", 2)
    ]
    assert r.param_match("model.layers.0.attn.wqkv.weight") == ("", "model.layers.0.attn.wqkv.weight", "")
    assert r.param_match("opt.state.model.layers.0.attn.wqkv.weight.exp_avg") == (
        "opt.state.", "model.layers.0.attn.wqkv.weight", ".exp_avg")
    assert r.logical_name("model.layers.0.attn.wqkv.weight", "wk") == "model.layers.0.attn.wk.weight"
    with pytest.raises(sp.UnsupportedStateError, match=r"dim 0 has 15 entries, the rule describes 2 x 8"):
        r.segments(15)


def test_shard_box_splits_across_groups():
    r = Fused("w", dim=0, groups=2, parts=[("a", 3), ("b", 1)])
    data = torch.arange(8 * 2).view(8, 2)
    # A TP-2 style shard holding rows [4, 8) = group 1.
    t = SaveTensor("x.w", data[4:], (8, 2), Box((4, 0), (4, 2)))
    out = {(p.fqn, p.box.offsets): p for p in apply_save([t], [r])}
    assert set(out) == {("a.w", (3, 0)), ("b.w", (1, 0))}
    assert torch.equal(out[("a.w", (3, 0))].data, data[4:7])
    assert out[("a.w", (3, 0))].shape == (6, 2)


@pytest.mark.parametrize("direction", ["fused->unfused", "unfused->fused"])
def test_fused_gqa_round_trip(tmp_path, direction):
    cf, cu = GPTConfig(**BASE, fused=True), GPTConfig(**BASE)
    rules = [cf.qkv_rule()]
    torch.manual_seed(0)
    src_cfg, dst_cfg = (cf, cu) if direction == "fused->unfused" else (cu, cf)
    src = TinyGPT(src_cfg)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    for s in range(2):
        train_step(src, opt, s, src_cfg)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": src, "optimizer": opt}, layouts=rules if src_cfg.fused else ())
    m = sp.read_manifest(path)
    assert "model.layers.0.attn.wq.weight" in m.tensors and not any("wqkv" in k for k in m.tensors)
    torch.manual_seed(9)
    dst = TinyGPT(dst_cfg)
    opt2 = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    sp.load(path, {"model": dst, "optimizer": opt2}, layouts=rules if dst_cfg.fused else ())
    fused, unfused = (src, dst) if src_cfg.fused else (dst, src)
    want = _unfuse(fused, cf)
    for k, v in unfused.state_dict().items():
        assert torch.equal(v, want[k]), k
    # Optimizer moments follow the same mapping, step counters included.
    of, ou = (opt, opt2) if src_cfg.fused else (opt2, opt)
    pf = dict(fused.named_parameters())["layers.1.attn.wqkv.weight"]
    pu = dict(unfused.named_parameters())["layers.1.attn.wk.weight"]
    hd, g = cf.dim // cf.heads, cf.heads // cf.kv
    k_rows = of.state[pf]["exp_avg"].view(cf.kv, g + 2, hd, cf.dim)[:, g].reshape(-1, cf.dim)
    assert torch.equal(ou.state[pu]["exp_avg"], k_rows)
    assert torch.equal(ou.state[pu]["step"], of.state[pf]["step"])
    # Training continues identically (up to float reassociation between the two layouts).
    a = train_step(src, opt, 2, src_cfg)
    b = train_step(dst, opt2, 2, dst_cfg)
    assert a == pytest.approx(b, rel=1e-5)


def test_padded_vocab(tmp_path):
    cp, cu = GPTConfig(**BASE, vocab_pad=56), GPTConfig(**BASE)
    rule = Padded("model.tok.weight", dim=0, size=cp.vocab)
    torch.manual_seed(0)
    src = TinyGPT(cp)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    train_step(src, opt, 0, cp)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": src, "optimizer": opt}, layouts=[rule])
    assert sp.read_manifest(path).tensors["model.tok.weight"].shape == (50, 32)
    dst = TinyGPT(cu)
    opt2 = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    sp.load(path, {"model": dst, "optimizer": opt2})
    assert torch.equal(dst.tok.weight, src.tok.weight[:50])
    # And back into a padded model: the padding comes back as zeros.
    back = TinyGPT(cp)
    sp.load(path, {"model": back}, keys="model.*", layouts=[rule])
    assert torch.equal(back.tok.weight[:50], src.tok.weight[:50])
    assert torch.count_nonzero(back.tok.weight[50:]) == 0
