"""A new framework joins through the adapter registry, with no change to the save or load code."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.adapters import Adapter, LoadPart, LoadTarget, SavePart, SaveTensor, register_adapter, registered_adapters, unregister_adapter
from shardpoint.adapters.landing import live_storages, unlanded
from shardpoint.errors import UnsupportedStateError
from shardpoint.geometry import Box

BUILT_IN = ["whole", "deepspeed", "optimizer", "fsdp1", "megatron", "module", "stateful", "values"]


class Ledger:
    """A toy framework object: a tensor of balances and a step counter, no ``state_dict``."""

    def __init__(self, balances: torch.Tensor, step: int):
        self.balances = balances
        self.step = step


class LedgerAdapter(Adapter):
    name = "ledger"

    def claims(self, obj):
        return isinstance(obj, Ledger)

    def save(self, key, obj, ctx):
        fqn = f"{key}.balances"
        shape = tuple(obj.balances.shape)
        index, count = ctx.plain_replica(fqn)
        t = SaveTensor(fqn, obj.balances, shape, Box.full(shape), replica_index=index, replica_count=count,
                       cost=float(obj.balances.nbytes))
        return SavePart(tensors=[t], value={"step": obj.step}, framework=self.name)

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>"):
        part = LoadPart()
        fqn = f"{key}.balances"
        shape = tuple(obj.balances.shape)
        if part.expect(tensors, fqn, shape, obj.balances.dtype, where) is not None:
            part.targets.append(LoadTarget(fqn, obj.balances, shape, Box.full(shape)))

        def finish():
            obj.step = doc["step"]
            return obj

        part.finish = finish
        part.landed = lambda targets: unlanded(targets, live_storages([obj.balances]))
        return part


@pytest.fixture
def ledger_adapter():
    register_adapter(LedgerAdapter)
    try:
        yield
    finally:
        unregister_adapter("ledger")
    assert registered_adapters() == BUILT_IN


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_built_in_order_is_most_specific_first_with_the_fallback_last():
    assert registered_adapters() == BUILT_IN


def test_an_unregistered_framework_object_is_refused(tmp_path):
    with pytest.raises(UnsupportedStateError, match=r"cannot encode Ledger at 'ledger'"):
        sp.save(str(tmp_path / "ckpt"), {"ledger": Ledger(torch.zeros(2), 0)})


def test_a_registered_adapter_saves_and_loads_its_object_bit_exact(ledger_adapter, tmp_path):
    assert registered_adapters() == ["whole", "deepspeed", "optimizer", "fsdp1", "megatron", "ledger", "module", "stateful", "values"]
    balances = torch.randn(5, 7, dtype=torch.float32).to(torch.bfloat16)
    balances[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)
    ckpt = str(tmp_path / "ckpt")
    sp.save(ckpt, {"ledger": Ledger(balances.clone(), 41), "lr": 0.5})

    manifest = sp.read_manifest(ckpt)
    assert manifest.layout["entries"] == {"ledger": "ledger", "lr": "values"}
    assert manifest.values["ledger"] == {"step": 41}
    assert torch.equal(_bits(sp.read_tensor(ckpt, "ledger.balances")), _bits(balances))

    target = Ledger(torch.zeros(5, 7, dtype=torch.bfloat16), 0)
    state = {"ledger": target, "lr": 0.0}
    sp.load(ckpt, state)
    assert state["ledger"] is target and target.step == 41 and state["lr"] == 0.5
    assert torch.equal(_bits(target.balances), _bits(balances))  # bit for bit: NaN and -0.0 included


def test_a_registered_adapter_loads_shape_mismatch_as_a_typed_error(ledger_adapter, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    sp.save(ckpt, {"ledger": Ledger(torch.ones(2, 3), 1)})
    with pytest.raises(sp.ShapeMismatchError, match=r"ledger\.balances"):
        sp.load(ckpt, {"ledger": Ledger(torch.zeros(3, 2), 0)})


def test_register_places_adapters_where_asked_and_rejects_misuse(ledger_adapter):
    @register_adapter(before="optimizer")
    class FirstAdapter(LedgerAdapter):
        name = "first"

    try:
        assert registered_adapters().index("first") == registered_adapters().index("optimizer") - 1
        with pytest.raises(ValueError, match=r"'first' is already registered"):
            register_adapter(FirstAdapter())
    finally:
        assert isinstance(unregister_adapter("first"), FirstAdapter)
    with pytest.raises(ValueError, match=r"before='nope'.*registered: \['whole'"):
        register_adapter(FirstAdapter, before="nope")
    with pytest.raises(TypeError, match=r"subclass of shardpoint\.adapters\.Adapter"):
        register_adapter(object())
    with pytest.raises(ValueError, match=r"fallback adapter 'values' cannot be removed"):
        unregister_adapter("values")
    assert "first" not in registered_adapters()


def test_an_adapter_must_implement_claims_save_and_load():
    class Partial(Adapter):
        name = "partial"

        def claims(self, obj):
            return False

    with pytest.raises(TypeError, match=r"abstract method.*load"):
        Partial()


def test_the_value_abilities_default_to_the_value_as_saved():
    adapter, value = LedgerAdapter(), {"step": 3}
    assert adapter.logical_value("ledger", value, rules=[sp.Fused("w", dim=0, parts=[("a", 2), ("b", 2)])]) is value
    assert adapter.read_value("ledger", Ledger(torch.zeros(1), 0), value, ctx=None, rules=[], where="ckpt") is value
