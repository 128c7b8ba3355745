"""Rank functions for tests/dist/test_restore.py: real-client state shapes restored through their protocol.

One job runs every case in one process group: for each, train, save, take
one more step (the uninterrupted run), load into objects built from another
seed, and compare every live tensor bit for bit and the next step's loss.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import shardpoint as sp
from shardpoint.adapters.landing import alias_key, module_tensors
from shardpoint.adapters.module import protocol_prefixes
from tests.clients.shapes import HookedNet, PartsOptimizer, TwoParts, loss_of, tensors_of

STEPS = 2


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _fsdp2(model: nn.Module, units) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    for u in units:
        fully_shard(u, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ------------------------------------------------------------------ builders: (model, optimizer, loss fn)
def _hooked(seed: int, titan: bool = False):
    torch.manual_seed(seed)
    m = HookedNet(titan=titan)
    _fsdp2(m, list(m.blocks))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), loss_of


def _parts(seed: int):
    torch.manual_seed(seed)
    m = TwoParts()
    _fsdp2(m, [m.front, m.back])
    return m, PartsOptimizer(m.parts()), loss_of


def _titan(seed: int):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(seed)
    m = TwoParts()
    _fsdp2(m, [m.front, m.back])
    cfg = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    )
    return m, OptimizersContainer(cfg, model_parts=m.parts()), loss_of


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )


def _llama_loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    out = model(input_ids=ids, labels=ids)
    return out.loss


def _llama(seed: int, layout: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(_llama_config()).float()
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied
    if layout == "fsdp2":
        _fsdp2(m, list(m.model.layers))
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        for i in range(len(m.model.layers)):
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
        parallelize_module(m, _mesh(), plan)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), _llama_loss


CASES = {
    "hooks_fsdp2": _hooked,
    "titan_hooks_fsdp2": lambda seed: _hooked(seed, titan=True),
    "parts_fsdp2": _parts,
    "titan_fsdp2": _titan,
    "llama_fsdp2": lambda seed: _llama(seed, "fsdp2"),
    "llama_tp": lambda seed: _llama(seed, "tp"),
}


# Cases whose parameters all alias their state-dict entries (the tied embedding included).
IN_PLACE = {"parts_fsdp2", "titan_fsdp2", "llama_fsdp2", "llama_tp"}


def _local(p):
    return getattr(p, "_local_tensor", p)


def _train(model, opt, loss_fn, start: int, steps: int) -> list[float]:
    out = []
    for s in range(start, start + steps):
        loss = loss_fn(model, s)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def run_job(rank: int, world: int, root: str, cases: list[str]) -> dict:
    out = {}
    for name in cases:
        path = os.path.join(root, name)
        model, opt, loss_fn = CASES[name](0)
        _train(model, opt, loss_fn, 0, STEPS)
        sp.save(path, {"model": model, "optimizer": opt})
        ref = tensors_of(model, opt)
        want = _train(model, opt, loss_fn, STEPS, 1)
        model2, opt2, _ = CASES[name](1)
        ptrs = [_local(p).data_ptr() for p in model2.parameters()]
        # Which entries the module adapter fills in place: those that alias a live tensor, in modules
        # that declare no load behaviour of their own.
        sd = model2.state_dict()
        live = {alias_key(t) for t in module_tensors(model2)}
        aliased = {n for n, t in sd.items() if alias_key(t) in live and not n.startswith(protocol_prefixes(model2))}
        if name in IN_PLACE:
            assert aliased == set(sd), (name, sorted(set(sd) - aliased))
        else:  # the hook's split copies go through load_state_dict; plain layers stay in place
            assert "blocks.0.attn.wq.weight" not in aliased and "blocks.0.out.weight" in aliased, sorted(aliased)
        report = sp.LoadResult()
        sp.load(path, {"model": model2, "optimizer": opt2}, report=report)
        if name in IN_PLACE:  # plain parameters: filled where they live, no load_state_dict copy
            assert [_local(p).data_ptr() for p in model2.parameters()] == ptrs, name
        got = tensors_of(model2, opt2)
        assert sorted(got) == sorted(ref), (name, sorted(set(got) ^ set(ref)))
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not bad, (name, bad[:5])
        assert len([k for k in ref if k.startswith("opt.")]) > 0, name
        after = _train(model2, opt2, loss_fn, STEPS, 1)
        assert after == want, (name, after, want)
        assert report.not_restored == [], (name, report.not_restored)
        out[name] = {"loss": after[0], "tensors": len(ref)}
    out["not_landed"] = _not_landed(os.path.join(root, "forgetful"))
    return out


def _not_landed(path: str) -> str:
    """A load that cannot land under FSDP2 raises the same typed error on every rank."""
    torch.manual_seed(0)
    m = _fsdp2(HookedNet(forgetful=True), [])
    sp.save(path, {"model": m})
    torch.manual_seed(1)
    m2 = _fsdp2(HookedNet(forgetful=True), [])
    try:
        sp.load(path, {"model": m2})
    except sp.StateNotRestoredError as e:
        msg = str(e)
        assert "'model.tail.bias'" in msg and "did not reach the live state" in msg, msg
        return type(e).__name__
    raise AssertionError("a load whose bias was dropped by _load_from_state_dict succeeded")
