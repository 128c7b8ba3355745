"""``export --to hf`` writes config.json, so ``from_pretrained(folder)`` opens the export directly.

A tiny ``LlamaForCausalLM`` is built from a ``LlamaConfig`` (no downloads),
saved with its config carried as the value ``extra.hf_config``, exported with
the CLI, and reopened with ``from_pretrained``: every weight must match bit for
bit and the config must round-trip.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardpoint as sp
from shardpoint.cli import main
from shardpoint.convert import export_hf
from shardpoint.errors import ConversionError
from shardpoint.convert.hf import HF_CONFIG_KEY, carried_config

transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_cli_export_writes_carried_config_and_from_pretrained_opens_it(tmp_path, capsys):
    model = _llama()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    sp.save(ckpt, {"model": model, "extra": {"step": 7, "hf_config": model.config.to_dict()}})
    assert HF_CONFIG_KEY == "extra.hf_config"
    assert carried_config(ckpt)["model_type"] == "llama"
    assert carried_config(ckpt)["id2label"] == model.config.to_dict()["id2label"]  # int keys decoded

    assert main(["export", ckpt, "--to", "hf", out]) == 0
    said = capsys.readouterr().out
    assert "config.json (from value extra.hf_config)" in said
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["hidden_size"] == 16 and written["num_key_value_heads"] == 1

    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back).__name__ == "LlamaForCausalLM"
    assert back.config.num_hidden_layers == 2 and back.config.vocab_size == 64
    _same_weights(model, back)


def test_export_config_argument_wins_and_other_key(tmp_path):
    model = _llama()
    ckpt = str(tmp_path / "ckpt")
    cfg = model.config.to_dict()
    sp.save(ckpt, {"model": model, "meta": {"config": cfg}, "extra": {"hf_config": {"model_type": "wrong"}}})

    r = export_hf(ckpt, str(tmp_path / "a"), config_key="meta.config")
    assert r.config == "value meta.config"
    _same_weights(model, transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "a")))

    r = export_hf(ckpt, str(tmp_path / "b"), config=cfg)  # a dict given directly wins over the carried one
    assert r.config == "argument"
    with open(tmp_path / "b" / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"

    path = tmp_path / "given.json"
    path.write_text(json.dumps(cfg))
    assert main(["export", ckpt, "--to", "hf", str(tmp_path / "c"), "--config", str(path), "-q"]) == 0
    with open(tmp_path / "c" / "config.json") as f:
        assert json.load(f) == json.loads(json.dumps(cfg, sort_keys=True))


def test_export_without_config_writes_none_and_bad_configs_are_refused(tmp_path, capsys):
    model = _llama()
    plain = str(tmp_path / "plain")
    sp.save(plain, {"model": model})
    r = export_hf(plain, str(tmp_path / "out"))
    assert r.config is None and not os.path.exists(tmp_path / "out" / "config.json")
    assert carried_config(plain) is None
    assert main(["export", plain, "--to", "hf", str(tmp_path / "out2")]) == 0
    assert "no config.json: pass --config, or save the model config as the value extra.hf_config" in capsys.readouterr().out

    bad = str(tmp_path / "bad")
    sp.save(bad, {"model": model, "extra": {"hf_config": [1, 2]}})
    with pytest.raises(ConversionError, match=r"value 'extra.hf_config' is a list, not a config dict"):
        export_hf(bad, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")  # refused before any weight was written

    holds_tensor = str(tmp_path / "tensor")
    sp.save(holds_tensor, {"model": model, "extra": {"hf_config": {"w": torch.ones(2)}}})
    with pytest.raises(ConversionError, match=r"holds tensor"):
        export_hf(holds_tensor, str(tmp_path / "y"))

    with pytest.raises(ConversionError, match=r"cannot read the config"):
        export_hf(plain, str(tmp_path / "z"), config=str(tmp_path / "missing.json"))
    assert main(["export", plain, "--to", "dcp", str(tmp_path / "d"), "--config-key", "x.y"]) == 2
    assert "--config-key" in capsys.readouterr().err
