"""Rank code for test_agree: a failure on one rank, in every phase and feature, reaches every rank in time.

One process group runs the cases in turn. Each case first saves a good
checkpoint, then plants a failure on rank 1 only (an entry whose
``state_dict()`` raises, a dtype the format refuses, a ``Reduced`` tensor
of another shape or dtype, a registered adapter whose ``implied_rules``
raises, a background write that raises, a tensor changed before a lazy
save's fence, a misfit load target, a ``meta`` module that cannot be given
storage, an entry whose ``load_state_dict()`` raises) and runs the call on
every rank. A case
records, per rank, the error's class, message, where it surfaced (``call``
or ``wait``) and how long it took, and whether the good checkpoint still
loads bit-exact afterwards (nothing was committed over it).

A case that hangs ends the rank after ``LIMIT`` seconds with every
thread's stack on stderr, after the line naming the case.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import shardpoint as sp
from shardpoint.adapters import Adapter, register_adapter, unregister_adapter

LIMIT = 20.0  # seconds a failing case may take before it counts as a hang
CAUSE = "planted failure on rank 1"


class Flaky:
    """An entry with its own protocol whose ``state_dict()`` or ``load_state_dict()`` raises when armed."""

    def __init__(self, save: bool = False, load: bool = False):
        self.save, self.load, self.value = save, load, torch.arange(4.0)

    def state_dict(self) -> dict:
        if self.save:
            raise RuntimeError(f"{CAUSE}: state_dict")
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        if self.load:
            raise RuntimeError(f"{CAUSE}: load_state_dict")
        self.value = sd["value"]


class Net(nn.Module):
    """A layer held alike by every rank and one local expert (global expert ``rank`` when ``experts``)."""

    def __init__(self, seed: int, expert: int, width: int = 4):
        super().__init__()
        torch.manual_seed(seed)
        self.dense = nn.Linear(4, width)
        torch.manual_seed(seed * 101 + 1000 + expert)
        self.experts = nn.ModuleList([nn.Linear(4, 4, bias=False)])


class Ema(nn.Module):
    """A running value as a module's buffer, the live state a load fills in place."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("ema", torch.zeros(n))


def _per_rank(case: str) -> tuple[bool, bool]:
    """Whether the case's state differs per rank in its reduced value, and in its experts (else ranks hold copies)."""
    return "reduced" in case or "experts" in case, "experts" in case


def _experts(world: int) -> list:
    return [sp.Experts("model.experts", num_experts=world, group=list(range(world)))]


def _layouts(case: str, world: int) -> list:
    reduced = [sp.Reduced("extra.ema")]
    return reduced + _experts(world) if "experts" in case else reduced if "reduced" in case else []


def _state(case: str, seed: int, rank: int, flaky: Flaky | None = None, width: int = 4) -> dict:
    ema, experts = _per_rank(case)
    state: dict[str, Any] = {
        "model": Net(seed, rank if experts else 0, width),
        "extra": {"ema": torch.full((3,), float(seed + (rank if ema else 0)))},
        "flaky": flaky if flaky is not None else Flaky(),
    }
    return state


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["extra.ema"] = state["extra"]["ema"].clone()
    out["flaky.value"] = state["flaky"].value.clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_of(fn: Callable[[], Any]) -> dict:
    """The error ``fn`` raises (at the call, or at ``wait()`` of the handle it returns) and how long it took."""
    t0 = time.monotonic()
    where = "call"
    try:
        h = fn()
        if hasattr(h, "wait"):
            where = "wait"
            h.wait()
        return {"type": None, "message": "", "where": where, "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return {"type": type(e).__name__, "message": str(e), "where": where, "seconds": time.monotonic() - t0}


class _Broken:
    """Makes ``cls.name`` raise on this rank (when ``armed``) for the ``with`` block."""

    def __init__(self, cls: Any, name: str, armed: bool):
        self.cls, self.name, self.armed = cls, name, armed

    def __enter__(self) -> "_Broken":
        self.real = getattr(self.cls, self.name)
        if self.armed:
            name = self.name

            def broken(*a, **k):
                raise RuntimeError(f"{CAUSE}: {name}")
            setattr(self.cls, self.name, broken)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.cls, self.name, self.real)


def _failing(case: str, rank: int) -> dict:
    """The state of a save that fails on rank 1.

    ``check`` cases: a dtype the format refuses; ``shape``/``dtype`` cases: a
    ``Reduced`` tensor of another shape or dtype than rank 0's; ``implied``
    cases: a healthy state (the failure is the adapter's, see :class:`Implying`);
    else a ``state_dict()`` that raises.
    """
    if "_check_" not in case and not case.endswith(("_shape", "_dtype", "implied", "implied_experts")):
        return _state(case, 1, rank, Flaky(save=rank == 1))
    state = _state(case, 1, rank)
    if rank == 1 and "_check_" in case:
        state["extra"]["odd"] = torch.zeros(2, dtype=torch.uint32)
    if rank == 1 and case.endswith("_shape"):
        state["extra"]["ema"] = torch.full((4,), 2.0)
    if rank == 1 and case.endswith("_dtype"):
        state["extra"]["ema"] = torch.full((3,), 2.0, dtype=torch.float64)
    return state


class Implying(Adapter):
    """A registered adapter that claims no object and implies ``rules`` for every state, or raises when ``armed``."""

    name = "implying"

    def __init__(self, rules: list, armed: bool):
        self.rules, self.armed = rules, armed

    def claims(self, obj: Any) -> bool:
        return False

    def save(self, key, obj, ctx):  # pragma: no cover - claims nothing
        raise NotImplementedError

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>"):  # pragma: no cover - claims nothing
        raise NotImplementedError

    def implied_rules(self, state) -> list:
        if self.armed:
            raise RuntimeError(f"{CAUSE}: implied_rules")
        return list(self.rules)


@contextlib.contextmanager
def implying(case: str, world: int, armed: bool):
    """:class:`Implying` registered for the ``with`` block of ``implied`` cases (implying experts where they have some)."""
    if "implied" not in case:
        yield
        return
    register_adapter(Implying(_experts(world) if "experts" in case else [], armed))
    try:
        yield
    finally:
        unregister_adapter(Implying.name)


def _manager(case: str, folder: str, layouts: list, kw: dict) -> Any:
    mode = "eager" if case.startswith("manager_async") else None
    return sp.CheckpointManager(folder, interval=1000, mode=mode, keep_last=None, save_options={"layouts": layouts, **kw})


def _save_case(case: str, rank: int, world: int, path: str) -> dict:
    """Plant the failure of ``case`` on rank 1 and run the save; the error record."""
    fail = rank == 1
    layouts = _layouts(case, world)
    if "implied" in case:  # the adapter implies the experts' rule
        layouts = [r for r in layouts if not isinstance(r, sp.Experts)]
    kw: dict = {"replicated_over": list(range(world))} if case.endswith("replicated") else {}
    if case.startswith("sync_"):
        state = _failing(case, rank)
        with implying(case, world, fail):
            return error_of(lambda: sp.save(path, state, layouts=layouts, **kw))
    if case.startswith("async_call_"):  # eager or lazy: the state fails at the call
        mode = "lazy" if "_lazy" in case else "eager"
        state = _failing(case, rank)
        with implying(case, world, fail):
            return error_of(lambda: sp.async_save(path, state, mode=mode, layouts=layouts, **kw))
    if case.startswith("prewarm_"):  # pre-warming meets the failure first and keeps quiet; the save raises it
        state = _failing(case, rank)
        with implying(case, world, fail):
            saver = sp.AsyncSaver(prewarm=False)
            try:
                saver.prewarm(state)
                return error_of(lambda: saver.save(path, state, layouts=layouts, **kw))
            finally:
                saver.close()
    if case.startswith("async_wait_eager"):  # the end of the background write fails (every rank runs it)
        from shardpoint.saving.transaction import SaveTransaction

        state = _state(case, 1, rank)
        with _Broken(SaveTransaction, "summarize", fail):
            return error_of(lambda: sp.async_save(path, state, mode="eager", layouts=layouts, **kw))
    if case.startswith("async_wait_lazy"):  # a parameter changes before the fence on rank 1
        state = _state(case, 1, rank)
        state["optimizer"] = torch.optim.SGD(state["model"].parameters(), lr=0.1)
        h = sp.async_save(path, state, mode="lazy", layouts=layouts, **kw)
        if fail:
            with torch.no_grad():
                state["model"].dense.weight.add_(1.0)
        return error_of(lambda: h)
    if case.startswith("manager_"):  # the next step fails: it must not be committed
        mgr = _manager(case, os.path.dirname(path), layouts, kw)
        state = _failing(case, rank)
        def save_and_wait() -> None:  # an asynchronous manager's failure surfaces at its wait()
            mgr.save(STEP + 1, state)
            mgr.wait()

        try:
            return error_of(save_and_wait)
        finally:
            mgr.close()
    raise ValueError(f"unknown case {case!r}")


STEP = 7  # the manager's committed step; the failing save is the next one


def _load_case(case: str, rank: int, world: int, path: str) -> dict:
    """Plant the failure of ``case`` on rank 1 and run the load; the error record."""
    fail = rank == 1
    layouts = _layouts(case, world)
    state = _state(case, 2, rank, Flaky(load=fail and case == "load_failing"), width=5 if fail and case == "load_misfit" else 4)
    if fail and case == "load_reduced_misfit":  # live state (a plain dict's value would be replaced, not filled)
        state["extra"] = Ema(4)
    if fail and case == "load_experts_misfit":
        state["model"].experts[0] = nn.Linear(5, 4, bias=False)
    if case == "load_index":  # this rank's index files cannot be read
        from shardpoint.loading import transaction

        with _Broken(transaction, "resolve", fail):
            return error_of(lambda: sp.load(path, state))
    if case == "load_meta":  # a module built on the meta device cannot be given storage on rank 1
        with torch.device("meta"):
            state["model"] = Net(2, 0)
        with _Broken(nn.Module, "to_empty", fail):
            return error_of(lambda: sp.load(path, state))
    with implying(case, world, fail):
        return error_of(lambda: sp.load(path, state, layouts=layouts))


def _good_save(case: str, rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    """Save the checkpoint the case must leave intact; what a load of it gives this rank."""
    state = _state(case, 0, rank)
    layouts = _layouts(case, world)
    if case.startswith("manager_"):
        mgr = _manager(case, os.path.dirname(path), layouts, {})
        mgr.save(STEP, state)
        mgr.close()
    else:
        sp.save(path, state, layouts=layouts)
    if _per_rank(case)[0]:  # every rank loads the mean of the ranks' values
        state["extra"]["ema"] = torch.full((3,), (world - 1) / 2)
    return _tensors(state)


def _kept(case: str, rank: int, world: int, path: str, want: dict[str, torch.Tensor]) -> bool:
    """The good checkpoint still loads bit-exact (and the manager's failed step was not committed)."""
    state = _state(case, 3, rank)
    sp.load(path, state, layouts=_layouts(case, world))
    kept = _same(want, _tensors(state))
    if case.startswith("manager_"):
        failed = os.path.join(os.path.dirname(path), f"step_{STEP + 1:08d}", "manifest.json")
        kept = kept and not os.path.exists(failed)
    return kept


def failures_job(rank: int, world: int, root: str, cases: list[str]) -> dict:
    """Run every case of ``cases`` in turn; see the module documentation."""
    out: dict[str, dict] = {}
    for case in cases:
        folder = os.path.join(root, case)
        path = os.path.join(folder, f"step_{STEP:08d}") if case.startswith("manager_") else os.path.join(folder, "ckpt")
        want = _good_save(case, rank, world, path)
        dist.barrier()
        print(f"rank {rank}: case {case} starts", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(LIMIT + 10, exit=True)  # a hang ends the rank, naming the case above
        try:
            rec = _load_case(case, rank, world, path) if case.startswith("load_") else _save_case(case, rank, world, path)
        finally:
            faulthandler.cancel_dump_traceback_later()
        dist.barrier()
        rec["kept"] = _kept(case, rank, world, path, want)
        out[case] = rec
    return out
