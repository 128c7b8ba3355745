"""Optimizer naming, shardpoint <-> DCP: pure document mappings, and the single-process round trips."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardpoint as sp
from shardpoint.convert import export_dcp, import_dcp
from shardpoint.adapters.dcp_names import dcp_param_name, dcp_to_native, is_dcp_optimizer_doc, is_native_optimizer_doc, native_to_dcp, rename_refs
from shardpoint.errors import FormatError, KeyMismatchError


def _ref(name: str) -> dict:
    return {"__sp__": "tensor", "key": name}


NATIVE = {
    "groups": [{"lr": 0.1, "betas": {"__sp__": "tuple", "v": [0.9, 0.99]}}, {"lr": 0.2}],
    "group_of": {"model.a.w": 0, "model.a.b": 0, "model.c._checkpoint_wrapped_module.w": 1},
    "state": {
        "model.a.w": {"step": _ref("optimizer.state.model.a.w.step"), "exp_avg": _ref("optimizer.state.model.a.w.exp_avg")},
        "model.c._checkpoint_wrapped_module.w": {"step": _ref("optimizer.state.model.c._checkpoint_wrapped_module.w.step")},
    },
}


def test_dcp_param_name_drops_state_key_and_wrappers():
    assert dcp_param_name("model.layers.0.w") == "layers.0.w"
    assert dcp_param_name("model._orig_mod.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert dcp_param_name("m.module.w") == "module.w"  # a real submodule called "module" stays


def test_native_to_dcp_and_back_keeps_groups_state_and_refs():
    dcp = native_to_dcp(NATIVE, "ck")
    assert is_dcp_optimizer_doc(dcp) and not is_native_optimizer_doc(dcp)
    assert dcp["param_groups"] == [
        {"lr": 0.1, "betas": {"__sp__": "tuple", "v": [0.9, 0.99]}, "params": ["a.w", "a.b"]},
        {"lr": 0.2, "params": ["c.w"]},
    ]
    assert dcp["state"]["a.w"]["exp_avg"] == _ref("optimizer.state.model.a.w.exp_avg")  # tensors keep their names
    assert set(dcp["state"]) == {"a.w", "c.w"}
    back = dcp_to_native(dcp, list(NATIVE["group_of"]), "ck")
    assert back == NATIVE


def test_dcp_to_native_leaves_unknown_names_for_the_strict_check():
    dcp = native_to_dcp(NATIVE, "ck")
    back = dcp_to_native(dcp, ["model.a.w"], "ck")
    assert back["group_of"] == {"model.a.w": 0, "a.b": 0, "c.w": 1}
    assert set(back["state"]) == {"model.a.w", "c.w"}


def test_mapping_errors_are_typed():
    clash = {**NATIVE, "group_of": {"model.w": 0, "other.w": 0}, "state": {}}
    with pytest.raises(FormatError, match="'model.w' and 'other.w' both have the DCP name 'w'"):
        native_to_dcp(clash, "ck")
    dcp = native_to_dcp(NATIVE, "ck")
    with pytest.raises(FormatError, match="matches several parameters"):
        dcp_to_native(dcp, ["model.a.w", "other.a.w"], "ck")
    with pytest.raises(FormatError, match="group 5 of 2"):
        native_to_dcp({**NATIVE, "group_of": {"model.a.w": 5}}, "ck")
    twice = {"state": {}, "param_groups": [{"params": ["a"]}, {"params": ["a"]}]}
    with pytest.raises(FormatError, match="listed in two groups"):
        dcp_to_native(twice, ["model.a"], "ck")
    with pytest.raises(FormatError, match="not a shardpoint optimizer"):
        native_to_dcp(twice, "ck")


def test_recognisers():
    assert is_native_optimizer_doc(NATIVE)
    assert not is_dcp_optimizer_doc({"state": {}, "param_groups": [{"params": [0, 1]}]})  # torch.optim ids
    assert not is_dcp_optimizer_doc({"state": {}, "param_groups": [], "extra": 1})
    assert is_dcp_optimizer_doc({"state": {}, "param_groups": []})
    assert rename_refs([NATIVE["state"]["model.a.w"]], str.upper)[0]["step"] == _ref("OPTIMIZER.STATE.MODEL.A.W.STEP")


_NAME = st.text("abc", min_size=1, max_size=3)


@given(st.dictionaries(st.lists(_NAME, min_size=1, max_size=3).map(".".join), st.integers(0, 2), min_size=1, max_size=8))
def test_round_trip_property(group_of):
    groups = [{"lr": float(i)} for i in range(3)]
    native_names = {f"model.{n}": g for n, g in group_of.items()}
    state = {n: {"step": _ref(f"optimizer.state.{n}.step")} for n in list(native_names)[::2]}
    doc = {"groups": groups, "group_of": native_names, "state": state}
    assert dcp_to_native(native_to_dcp(doc), list(native_names)) == doc


# ------------------------------------------------------------------ with real objects, one process
def _trained(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _same_optimizer(a, ma, b, mb) -> bool:
    pairs = list(zip(ma.parameters(), mb.parameters()))
    return all(
        a.state[p].keys() == b.state[q].keys() and all(torch.equal(a.state[p][k], b.state[q][k]) for k in a.state[p])
        for p, q in pairs
    ) and [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in b.param_groups
    ]


def test_load_checkpoint_keyed_the_dcp_way(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    m, opt = _trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt)})
    assert "optimizer.state.0.weight.exp_avg" in sp.read_manifest(path).tensors
    m2, o2 = _trained(1)
    o2.param_groups[0]["lr"] = 0.5
    sp.load(path, {"model": m2, "optimizer": o2})
    assert _same_optimizer(opt, m, o2, m2) and all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    assert float(o2.state[m2[0].weight]["step"]) == 2.0

    # A parameter of the target that the checkpoint does not know is still reported.
    m3 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    o3 = torch.optim.AdamW(m3.parameters())
    with pytest.raises(KeyMismatchError, match=r"optimizer\.state\.model\.3\.weight"):
        sp.load(path, {"model": m3, "optimizer": o3}, keys="optimizer.*")


def test_dcp_both_ways_with_optimizer(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict

    m, opt = _trained()
    src = str(tmp_path / "dcp_in")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt)}, checkpoint_id=src)
    ck = str(tmp_path / "ck")
    import_dcp(src, ck, allow_pickle=True)
    man = sp.read_manifest(ck)
    assert "optimizer.state.model.0.weight.exp_avg" in man.tensors and man.layout["entries"]["optimizer"] == "optimizer:dcp"
    m2, o2 = _trained(1)
    sp.load(ck, {"model": m2, "optimizer": o2})
    assert _same_optimizer(opt, m, o2, m2)

    out = str(tmp_path / "dcp_out")
    export_dcp(ck, out)
    m3, o3 = _trained(2)
    sd = {"model": get_model_state_dict(m3), "optimizer": get_optimizer_state_dict(m3, o3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=out)
    set_model_state_dict(m3, sd["model"])
    set_optimizer_state_dict(m3, o3, sd["optimizer"])
    assert _same_optimizer(opt, m, o3, m3)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m3.parameters()))


def test_non_strict_load_of_an_empty_dict_returns_everything(tmp_path):
    m, opt = _trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optimizer": opt, "extra": {"step": 2, "t": (1, 2.5), "x": torch.arange(3)}, "w": torch.ones(2)})
    got = sp.load(path, {}, strict=False)
    assert sorted(got) == ["extra", "model", "optimizer", "w"]
    assert got["model"].keys() == m.state_dict().keys() and all(torch.equal(got["model"][k], v) for k, v in m.state_dict().items())
    assert got["extra"]["step"] == 2 and got["extra"]["t"] == (1, 2.5) and torch.equal(got["extra"]["x"], torch.arange(3))
    assert torch.equal(got["w"], torch.ones(2))
    assert torch.equal(got["optimizer"]["state"]["model.0.weight"]["exp_avg"], opt.state[m[0].weight]["exp_avg"])
    assert got["optimizer"]["groups"][0]["lr"] == 1e-2 and got["optimizer"]["group_of"]["model.2.bias"] == 0
    assert sorted(sp.load(path, {}, strict=False, keys="extra.*")) == ["extra"]
    with pytest.raises(KeyMismatchError):
        sp.load(path, {})  # strict: an empty dict is still a mismatch
