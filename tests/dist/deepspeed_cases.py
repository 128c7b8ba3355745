"""Rank functions for DeepSpeed ZeRO 1/2/3 (run by shardpoint.testing.launch).

A layout is one of :data:`shardpoint.testing.LAYOUTS` or ``zero1``/``zero2``/
``zero3``: a TinyGPT under ``deepspeed.initialize`` with a torch AdamW, fp32,
no gradient clipping (DeepSpeed clips at 1.0 by default; the other layouts do
not clip). Checkpoints are saved under one layout and loaded under another;
model and optimizer must then equal the source's full reference bit for bit,
and the next training steps must give the source's losses. The DeepSpeed
reference is gathered with DeepSpeed's own ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``, independent of shardpoint. ``<name>.native``
sources are DeepSpeed's own ``engine.save_checkpoint`` folders, converted with
:func:`shardpoint.convert.deepspeed_native.import_deepspeed` first.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.testing import (
    GPTConfig,
    TinyGPT,
    batch,
    build,
    full_state,
    loss_of,
    train_step,
)
from tests.dist.checks import check_continued_losses, check_reference, load_record, write_reference

# Odd sizes, so that ZeRO partitions cut parameters in the middle of rows.
CFG = GPTConfig(vocab=61, dim=24, heads=4, layers=4, seq=8)
TRAIN_STEPS = 2
NEXT_STEPS = 2

__all__ = ["ds_config", "build_ds", "make", "step", "reference", "save_job", "load_job", "errors_job", "lazy_job", "CFG"]


def _deepspeed():
    import deepspeed
    import deepspeed.ops

    # With DS_ACCELERATOR=cpu, deepspeed.initialize JIT-compiles a shared-memory all-reduce op
    # (deepspeed_shm_comm) on first use: about 4 minutes on 2 cores, and it needs g++ and ninja.
    # ZeRO does not need it (gloo carries every collective); DeepSpeed skips it when the op is
    # marked incompatible, which is what this does.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def ds_config(layout: str) -> dict:
    """The DeepSpeed config of ``zero<stage>[-variant...]``.

    Variants: ``rr`` round-robin gradient ordering (ZeRO-1/2 reorder the flat
    group), ``sg`` small ZeRO-3 sub-groups and no persistent parameters,
    ``bf16`` bf16 training with fp32 masters, ``fp16`` fp16 with dynamic loss scaling.
    """
    stage, *variants = layout.removeprefix("zero").split("-")
    zero: dict = {"stage": int(stage)}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    for v in variants:
        if v == "rr":
            zero["round_robin_gradients"] = True
        elif v == "sg":
            zero.update(sub_group_size=1000, stage3_param_persistence_threshold=0)
        elif v == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif v == "fp16":  # dynamic loss scaling from 2**16: the first steps overflow and are skipped
            cfg["fp16"] = {"enabled": True}
        else:
            raise ValueError(f"unknown DeepSpeed variant {v!r} in {layout!r}")
    return cfg


def build_ds(layout: str, c: GPTConfig = CFG, seed: int = 0, lr: float = 1e-2):
    """A TinyGPT under DeepSpeed (``zero1``, ``zero3-sg``, ...) with a torch AdamW (the same as ``build``'s)."""
    ds = _deepspeed()
    torch.manual_seed(seed)
    model = TinyGPT(c)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, zopt, _, _ = ds.initialize(model=model, optimizer=opt, config=ds_config(layout))
    return engine, zopt


def make(layout: str, seed: int):
    if layout.startswith("zero"):
        return build_ds(layout, CFG, seed)
    return build(layout, CFG, seed)


def step(layout: str, model, opt, s: int) -> float:
    if layout.startswith("zero"):
        x, y = batch(s, CFG)
        loss = loss_of(model, x, y)
        model.backward(loss)
        model.step()
        return float(loss.detach())
    return train_step(model, opt, s, CFG)


def _rr_gather(zopt, p, tensor_of_group) -> torch.Tensor:
    # ZeRO-1/2 with round_robin_gradients: DeepSpeed 0.19.8's safe_get_full_* helpers map
    # parameters in the original order onto a flat buffer built in round-robin order, and
    # return other parameters' elements. Gather the flat group (padding back on) and cut it
    # at DeepSpeed's own round-robin offsets instead.
    for i, group in enumerate(zopt.round_robin_bit16_groups):
        for q, off in zip(group, zopt.round_robin_bit16_offsets[i]):
            if q is p:
                local = tensor_of_group(i).detach().reshape(-1)
                local = torch.cat([local, local.new_zeros(zopt.partition_size[i] - local.numel())])
                parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, local)
                return torch.cat(parts)[off : off + p.numel()].reshape(p.shape).clone()
    raise KeyError("parameter not in any ZeRO group")


def _ds_full_state(engine, zopt) -> dict[str, torch.Tensor]:
    # DeepSpeed's own gathers (collectives), independent of shardpoint's geometry.
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    inner = zopt.optimizer
    states = [s for s in inner.state.values() if s]
    keys = sorted(k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0) if states else []
    rr = getattr(zopt, "round_robin_gradients", False)
    fp32 = getattr(zopt, "single_partition_of_fp32_groups", None)
    for n, p in engine.module.named_parameters():
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        if rr:
            out[f"model.{n}"] = _rr_gather(zopt, p, lambda i: fp32[i])
        else:
            out[f"model.{n}"] = safe_get_full_fp32_param(p).detach().reshape(shape).clone()
        for k in keys:
            if rr:
                out[f"opt.{n}.{k}"] = _rr_gather(zopt, p, lambda i, k=k: inner.state[fp32[i]][k])
            else:
                out[f"opt.{n}.{k}"] = safe_get_full_optimizer_state(p, k).detach().reshape(shape).clone()
        if states:
            out[f"opt.{n}.step"] = states[0]["step"].detach().clone()
    for n, b in engine.module.named_buffers():
        out[f"model.{n}"] = b.detach().clone()
    return out


def reference(layout: str, model, opt) -> dict[str, torch.Tensor]:
    return _ds_full_state(model, opt) if layout.startswith("zero") else full_state(model, opt)


def save_job(rank: int, world: int, root: str, layouts: list[str], native: list[str] = ()) -> dict:
    """Train each layout a few steps, save it (and a native DeepSpeed checkpoint), record the reference."""
    out = {}
    for layout in layouts:
        name = f"{layout}{world}"
        model, opt = make(layout, 0)
        for s in range(TRAIN_STEPS):
            step(layout, model, opt, s)
        state = {"model": model, "optimizer": opt, "extra": {"step": TRAIN_STEPS, "layout": layout}}
        res = sp.save(os.path.join(root, name), state)
        if layout in native:
            model.save_checkpoint(os.path.join(root, f"{name}.native"))
        ref = reference(layout, model, opt)
        losses = [step(layout, model, opt, TRAIN_STEPS + i) for i in range(NEXT_STEPS)]
        if rank == 0:
            write_reference(root, name, ref, losses)
        m = sp.read_manifest(os.path.join(root, name))
        flat = sum(1 for t in m.tensors.values() for c in t.chunks if c.flat is not None)
        out[name] = {
            "bytes": res.bytes_written,
            "flat_chunks": flat,
            "total": m.total_bytes,
            "entries": m.layout.get("entries", {}),
            "model_doc": m.values.get("model"),
        }
    return out


def _convert(root: str, src: str, world: int) -> str:
    """Rank 0 converts a native DeepSpeed folder once; everyone waits for it."""
    from shardpoint.convert.deepspeed_native import import_deepspeed

    out = os.path.join(root, f"{src}.sp{world}")
    if dist.get_rank() == 0:
        import_deepspeed(os.path.join(root, src), out, allow_pickle=True)
    dist.barrier()
    return out


def load_job(rank: int, world: int, root: str, cases: list[list[str]]) -> dict:
    """Load each saved checkpoint into another layout; compare bit-exactly, then train on."""
    out = {}
    for src, layout in cases:
        native = src.endswith(".native")
        base = src[: -len(".native")] if native else src
        path = _convert(root, src, world) if native else os.path.join(root, src)
        model, opt = make(layout, 1234)  # a different init: the load must overwrite everything
        state = {"model": model, "optimizer": opt} if native else {"model": model, "optimizer": opt, "extra": {}}
        report = sp.LoadResult()
        sp.load(path, state, report=report)
        if not native:
            assert state["extra"]["step"] == TRAIN_STEPS, state["extra"]
        if layout.startswith("zero"):
            assert state["model"] is model and state["optimizer"] is opt
            if native or base.startswith("zero"):
                assert model.global_steps == TRAIN_STEPS, model.global_steps
        got = reference(layout, model, opt)
        check_reference(root, base, got, f"{src} -> {layout}{world}")
        losses = [step(layout, model, opt, TRAIN_STEPS + i) for i in range(NEXT_STEPS)]
        check_continued_losses(root, base, losses, f"{src} -> {layout}{world}")
        out[f"{src}->{layout}{world}"] = load_record(losses, report)
    return out


def errors_job(rank: int, world: int, root: str) -> dict:
    """What must fail loudly: a ZeRO module saved without its optimizer, a ZeRO optimizer without its model."""
    out = {}
    engine, zopt = build_ds("zero1")
    step("zero1", engine, zopt, 0)
    for name, state in (("module_alone", {"model": engine.module}), ("optimizer_alone", {"optimizer": zopt})):
        try:
            sp.save(os.path.join(root, name), state)
            out[name] = None
        except sp.CheckpointError as e:
            out[name] = f"{type(e).__name__}: {e}"
    # engine.module next to its optimizer is fine, and names match the engine form.
    sp.save(os.path.join(root, "module_form"), {"model": engine.module, "optimizer": zopt})
    sp.save(os.path.join(root, "engine_form"), {"model": engine, "optimizer": zopt})
    a = sp.read_manifest(os.path.join(root, "module_form"))
    b = sp.read_manifest(os.path.join(root, "engine_form"))
    out["same_names"] = sorted(a.tensors) == sorted(b.tensors)
    out["names"] = len(a.tensors)
    return out


def lazy_job(rank: int, world: int, root: str, layouts: list[str]) -> dict:
    """Lazy asynchronous saves of ZeRO engines: the optimizer state is copied after the call, fenced before the step.

    A step right after the call must wait for the copy (the checkpoint holds
    the state at the call, bit for bit), and an in-place change of the
    optimizer state before the fence must fail the save.
    """
    from shardpoint.device import SimulatedDevice

    out = {}
    for layout in layouts:
        engine, zopt = make(layout, 0)
        for s in range(TRAIN_STEPS):
            step(layout, engine, zopt, s)
        state = {"model": engine, "optimizer": zopt}
        saver = sp.AsyncSaver(staging_bytes=64 << 10, piece_bytes=4 << 10, device=SimulatedDevice(delay=0.002))
        try:
            at_call = reference(layout, engine, zopt)
            path = os.path.join(root, f"{layout}.lazy")
            handle = saver.save(path, state, mode="lazy")
            step(layout, engine, zopt, TRAIN_STEPS)  # at once: the step pre-hook holds the update back
            handle.wait()
            stepped = reference(layout, engine, zopt)
            engine2, zopt2 = make(layout, 1)
            sp.load(path, {"model": engine2, "optimizer": zopt2})
            got = reference(layout, engine2, zopt2)
            handle = saver.save(os.path.join(root, f"{layout}.torn"), state, mode="lazy")
            with torch.no_grad():
                for st in zopt.optimizer.state.values():
                    st["exp_avg"].mul_(0.5)  # outside the step: only the guard of a lazy copy sees it
            try:
                handle.wait()
                torn = None
            except sp.TornSnapshotError as e:
                torn = str(e)
        finally:
            saver.close()
        out[layout] = {
            "keys": len(at_call),
            "differ": sorted(k for k in at_call if not torch.equal(at_call[k], got[k])),
            "step_ran": any(not torch.equal(at_call[k], stepped[k]) for k in at_call),
            "torn": torn,
        }
    return out
