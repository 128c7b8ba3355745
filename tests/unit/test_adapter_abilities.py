"""Adapters say what is framework-specific through abilities: context facts, implied rules, what a step updates.

A registered adapter for an optimizer that is not a ``torch.optim.Optimizer``
declares its object stepped: a lazy save then copies its state after the call
returns, fenced by the adapter's step pre-hook, and a change before the fence
fails the save.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import shardpoint as sp
from shardpoint.adapters import (
    Adapter, ContextFacts, LoadPart, SavePart, build_context, implied_rules, register_adapter, unregister_adapter,
)
from shardpoint.adapters.stepped import step_updates
from shardpoint.adapters.landing import live_storages, unlanded
from shardpoint.adapters.tensors import load_target, save_tensor
from shardpoint.device import SimulatedDevice
from shardpoint.dist import Comm
from shardpoint.saving import SaveOptions, SaveTransaction
from shardpoint.saving.reuse import SaveCache
from tests.unit.models import differing


class SignSGD:
    """A hand-written optimizer: one momentum tensor per parameter, pre-hooks run at the start of ``step()``."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9):
        self.params = list(params)
        self.lr, self.beta = lr, beta
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.hooks: OrderedDict[int, object] = OrderedDict()  # RemovableHandle holds it weakly

    def add_hook(self, fn) -> RemovableHandle:
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = fn
        return handle

    def step(self) -> None:
        for fn in list(self.hooks.values()):
            fn()
        with torch.no_grad():
            for p, m in zip(self.params, self.momentum):
                m.mul_(self.beta).add_(p.grad, alpha=1 - self.beta)
                p.add_(m.sign(), alpha=-self.lr)


class SignSGDAdapter(Adapter):
    name = "signsgd"

    def claims(self, obj):
        return isinstance(obj, SignSGD)

    @staticmethod
    def _named(key, opt, ctx):
        return [(ctx.param_names[id(p)], p, m, f"{key}.momentum.{ctx.param_names[id(p)]}") for p, m in zip(opt.params, opt.momentum)]

    def save(self, key, opt, ctx):
        return SavePart([save_tensor(fqn, m, ctx) for _, _, m, fqn in self._named(key, opt, ctx)], {"lr": opt.lr}, self.name)

    def load(self, key, opt, doc, tensors, ctx, where="<checkpoint>"):
        part = LoadPart()
        for _, _, m, fqn in self._named(key, opt, ctx):
            if part.expect(tensors, fqn, tuple(m.shape), m.dtype, where) is not None:
                part.targets.append(load_target(fqn, m))
        part.finish = lambda: opt
        part.landed = lambda targets: unlanded(targets, live_storages(opt.momentum))  # filled in place
        return part

    def is_stepped(self, obj):
        return True  # counts only for the objects it claims (not for the model)

    def step_updates(self, key, opt, ctx):
        out = []
        for name, p, m, fqn in self._named(key, opt, ctx):
            out += [(name, p), (fqn, m)]
        return out

    def add_step_pre_hook(self, opt, hook):
        return opt.add_hook(hook)


@pytest.fixture
def signsgd():
    register_adapter(SignSGDAdapter)
    try:
        yield
    finally:
        unregister_adapter("signsgd")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = SignSGD(model.parameters())
    _step(model, opt)
    return model, opt


def _step(model, opt):
    for p in model.parameters():
        p.grad = None
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"o.{i}": m.clone() for i, m in enumerate(opt.momentum)})
    return out


def _loaded(path) -> dict[str, torch.Tensor]:
    model, opt = _setup(seed=123)  # other values everywhere, momentum included
    sp.load(path, {"model": model, "optimizer": opt})
    return _snapshot(model, opt)


def test_a_registered_optimizer_declares_what_its_step_updates(signsgd):
    model, opt = _setup()
    state = {"model": model, "optimizer": opt}
    comm = Comm.resolve(None)
    prep = SaveTransaction("prewarm", state, SaveOptions()).rehearse(comm, comm, SaveCache())
    params = {f"model.{n}" for n, _ in model.named_parameters()}
    assert prep.lazy_ok == params | {f"optimizer.momentum.{n}" for n in params}  # none of them before the ability
    updates = step_updates(state)
    assert [k for k, _, _ in updates.stepped] == ["optimizer"]
    order = updates.order(build_context(state, 0, 1))
    assert order[0] is opt.params[0] and order[1] is opt.momentum[0] and len(order) == 8
    calls = []
    handles = updates.add_pre_hooks(lambda o, args, kwargs: calls.append(o))
    _step(model, opt)
    for h in handles:
        h.remove()
    _step(model, opt)
    assert calls == [opt]


def test_lazy_save_of_a_registered_optimizer_orders_its_step_after_the_copy(tmp_path, signsgd):
    model, opt = _setup()
    saver = sp.AsyncSaver(staging_bytes=12 << 10, piece_bytes=4 << 10, device=SimulatedDevice(delay=0.005))
    try:
        for k in range(2):
            expect = _snapshot(model, opt)
            h = saver.save(str(tmp_path / f"l{k}"), {"model": model, "optimizer": opt}, mode="lazy")
            _step(model, opt)  # right away: the adapter's pre-hook holds the update back until the copy ran
            h.wait()
            assert differing(_loaded(str(tmp_path / f"l{k}")), expect) == []
            assert differing(_snapshot(model, opt), expect)  # the step did run
    finally:
        saver.close()


def test_a_change_to_its_state_before_the_fence_fails_the_lazy_save(tmp_path, signsgd):
    model, opt = _setup()
    path = str(tmp_path / "ckpt")
    saver = sp.AsyncSaver(staging_bytes=8 << 20, prewarm=False)
    try:
        saver.save(path, {"model": model, "optimizer": opt}).wait()
        before = _snapshot(model, opt)
        _step(model, opt)
        handle = saver.save(path, {"model": model, "optimizer": opt}, mode="lazy")
        opt.momentum[1].mul_(0.5)  # outside the step: only the lazy copy's guard can see it
        with pytest.raises(sp.TornSnapshotError, match=r"optimizer\.momentum\.model\.0\.bias"):
            handle.wait()
        assert differing(_loaded(path), before) == []  # the previous checkpoint, bit for bit
    finally:
        saver.close()


def test_build_context_takes_a_registered_adapters_facts():
    class Tagged(nn.Linear):
        pass

    class TaggedAdapter(Adapter):
        name = "tagged"

        def claims(self, obj):
            return isinstance(obj, Tagged)

        def save(self, key, obj, ctx):
            return SavePart(framework=self.name)

        def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>"):
            return LoadPart(finish=lambda: obj)

        def context_facts(self, key, obj, state):
            if not isinstance(obj, Tagged):
                return None
            return ContextFacts(names={id(obj.weight): f"{key}.global.weight"}, live_group_keys={7: frozenset({"name"})})

        def implied_rules(self, state):
            return [sp.Experts(f"{k}.experts", num_experts=2) for k, v in state.items() if isinstance(v, Tagged)]

    plain, tagged = nn.Linear(2, 2), Tagged(2, 2)
    register_adapter(TaggedAdapter)
    try:
        ctx = build_context({"a": plain, "b": tagged}, 0, 1)
        rules = implied_rules({"a": plain, "b": tagged})
    finally:
        unregister_adapter("tagged")
    # The first adapter that answers gives the entry's facts: the module adapter never sees ``b``.
    assert ctx.param_names == {id(plain.weight): "a.weight", id(plain.bias): "a.bias", id(tagged.weight): "b.global.weight"}
    assert ctx.live_group_keys == {7: frozenset({"name"})} and ctx.views == {} and ctx.shards == {}
    assert [(r.prefix, r.num_experts) for r in rules] == [("b.experts", 2)]
    assert implied_rules({"b": tagged}) == []  # unregistered: nothing implied


def test_an_adapter_that_declares_a_step_it_cannot_hook_is_refused():
    class Half(SignSGDAdapter):
        name = "half"
        add_step_pre_hook = Adapter.add_step_pre_hook

    with pytest.raises(sp.UnsupportedStateError, match="override add_step_pre_hook"):
        Half().add_step_pre_hook(SignSGD([]), lambda: None)
