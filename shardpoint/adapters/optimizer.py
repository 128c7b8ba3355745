"""``torch.optim.Optimizer`` state, keyed by parameter names, never by integer ids.

Each per-parameter state tensor is stored as ``<key>.state.<param fqn>.<name>``
and follows its parameter's geometry (a DTensor for FSDP2/TP, a replicated
tensor for DDP). Loading works on a freshly built optimizer that has never
stepped: state tensors are allocated from the manifest, sharded like their
parameter, and installed without running a step. Existing state tensors
that match what would be allocated are filled in place instead
(:func:`reusable_state`).

A parameter that packs several original parameters (an FSDP1 flat
parameter, or a ``use_orig_params`` 1-D view of one) has *views* in the
context (:class:`~shardpoint.adapters.base.ParamView`). Its state is split:
state shaped like the local tensor is cut into one flat-range piece per
original parameter, ``<key>.state.<orig fqn>.<name>``; other state (the
scalar ``step``) is stored once per original parameter, replicated over the
ranks holding pieces of it. Loading reassembles the local state in place,
with zeros in padding, so FSDP1 state moves to and from any layout.

A load restores each param group's saved hyper-parameters, except the keys
the context lists for this optimizer in ``live_group_keys``: a framework
adapter declares there the keys that describe the live run (the name a
group's process groups are looked up by), which keep their live values.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from ..errors import IncompleteStateError, ShapeMismatchError, UnsupportedStateError
from ..format.values import check_optimizer_doc, decode_value, encode_value
from ..geometry import Box
from ..layouts import optimizer_doc_to_logical, optimizer_doc_to_physical
from .dcp_names import dcp_to_native, is_dcp_optimizer_doc
from .base import Adapter, AdapterContext, LoadPart, LoadTarget, ParamView, SavePart, SaveTensor, dtype_name, torch_dtype
from .reuse import optimizer_fingerprint, refresh_groups
from .landing import live_storages, optimizer_tensors, unlanded
from .torch_steps import torch_capturable, torch_step_pre_hook, torch_step_updates
from .tensors import empty_like_target, is_dtensor, load_target, local_shard, save_tensor

# State that is one value per parameter even when the parameter itself is 0-d.
_SCALAR_STATE = frozenset({"step"})

__all__ = ["OptimizerAdapter", "param_name", "param_names", "reusable_state", "own_protocol", "check_saved_state"]

log = logging.getLogger("shardpoint")


def param_name(key: str, p: torch.Tensor, gi: int, i: int, ctx: AdapterContext) -> str:
    """The parameter's fully qualified name, or a positional fallback if no module owns it."""
    return ctx.param_names.get(id(p), f"{key}.unnamed.{gi}.{i}")


def param_names(opt: torch.optim.Optimizer, ctx: AdapterContext) -> list[str]:
    """The state names of ``opt``'s parameters (those a module in the state owns).

    Example::

        param_names(opt, build_context(state, 0, 1, False))  # ['model.w', 'model.b']
    """
    names = (ctx.param_names.get(id(p)) for g in opt.param_groups for p in g["params"])
    return [n for n in names if n is not None]


def own_protocol(cls: type) -> bool:
    """Whether an optimizer class declares its own state protocol by overriding torch's.

    Such a class (an optimizer container whose ``.state`` is empty and whose
    ``state_dict``/``load_state_dict`` delegate to inner optimizers, say) is an
    optimizer only by inheritance: its state is what those methods say, so it
    is saved and loaded through them (:class:`~shardpoint.adapters.tree.StatefulAdapter`).
    """
    base = torch.optim.Optimizer
    return cls.state_dict is not base.state_dict or cls.load_state_dict is not base.load_state_dict


def _inner_optimizers(opt: Any) -> dict[str, bool]:
    """Attributes of ``opt`` that hold other optimizers (directly or in a list): name -> whether any holds state."""
    found = {}
    for k, v in vars(opt).items():
        items = v if isinstance(v, (list, tuple)) else [v]
        inner = [x for x in items if isinstance(x, torch.optim.Optimizer) and x is not opt]
        if inner:
            found[k] = any(bool(x.state) for x in inner)
    return found


def check_saved_state(key: str, opt: Any, state_tensors: int) -> None:
    """Refuse or flag an optimizer whose saved state holds no tensors although it should.

    An optimizer whose own ``.state`` is empty while the optimizers it holds
    have state keeps its real state in them: saving it would save nothing, so
    that is an error (a warning while they have none yet). A subclass from
    outside torch with an empty ``.state`` while its parameters hold
    gradients may have stepped without recording state here; that gets a
    warning.
    """
    if state_tensors or not isinstance(opt, torch.optim.Optimizer) or opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params:
        return
    inner = _inner_optimizers(opt)
    what = (
        f"state[{key!r}]: {type(opt).__qualname__} is a torch.optim.Optimizer with an empty .state that "
        f"holds other optimizers ({', '.join(sorted(inner))}): its state lives there and would not be saved. Give "
        "the class state_dict()/load_state_dict() methods that delegate to them, or put each inner "
        "optimizer in the state as its own entry"
    )
    if any(inner.values()):
        raise IncompleteStateError(what)
    if inner:  # nothing stepped yet, so nothing is lost now; every later save would be
        log.warning("%s", what)
        return
    if any(p.grad is not None for p in params) and not type(opt).__module__.startswith("torch."):
        log.warning(
            "state[%r]: %s has parameters with gradients but no optimizer state to save; if it keeps its "
            "state elsewhere, give it state_dict()/load_state_dict() methods",
            key, type(opt).__qualname__,
        )


class OptimizerAdapter(Adapter):
    """``torch.optim.Optimizer`` state by parameter name; classes with their own protocol are not claimed."""

    name = "optimizer"

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer) and not own_protocol(type(obj))

    def save(self, key: str, opt: torch.optim.Optimizer, ctx: AdapterContext) -> SavePart:
        part = SavePart(framework=f"optimizer:{type(opt).__name__}")

        def on_tensor(fqn, t):
            st = save_tensor(fqn, t, ctx)
            if st is not None:
                part.tensors.append(st)

        groups, group_of, state = [], {}, {}
        for gi, g in enumerate(opt.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append(encode_value(hyper, f"{key}.groups.{gi}", on_tensor, ctx.allow_pickle))
            for i, p in enumerate(g["params"]):
                s = opt.state.get(p)
                views = ctx.views.get(id(p))
                if views is not None:
                    for v in views:
                        group_of[v.fqn] = gi
                        if s and v.flat is not None:
                            path = f"{key}.state.{v.fqn}"
                            state[v.fqn] = encode_value(
                                dict(s), path, lambda f, t, p=p, v=v: _append(part.tensors, _view_piece(f, t, p, v)), ctx.allow_pickle
                            )
                    continue
                name = param_name(key, p, gi, i, ctx)
                group_of[name] = gi
                if s:
                    state[name] = encode_value(dict(s), f"{key}.state.{name}", _on_state(p, ctx, on_tensor, part), ctx.allow_pickle)
        part.value = {"groups": groups, "group_of": group_of, "state": state}
        stepped = [t for t in part.tensors if t.fqn.startswith(f"{key}.state.")]
        for t in stepped:
            t.step_only = True  # the optimizer's state changes only inside its step()
        check_saved_state(key, opt, len(stepped))
        return part

    def is_stepped(self, obj: Any) -> bool:
        """Yes for the optimizers it claims: a torch optimizer changes its parameters and state only inside ``step()``."""
        return self.claims(obj)

    def step_updates(self, key: str, opt: Any, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """Each named parameter, then its state tensors (:func:`torch_step_updates`)."""
        return torch_step_updates(key, opt, ctx, with_state=True)

    def steps_in_graph(self, obj: Any) -> bool:
        """Yes when a param group is ``capturable`` (:func:`torch_capturable`)."""
        return torch_capturable(obj)

    def add_step_pre_hook(self, opt: Any, hook: Callable[[], None]) -> Any:
        """A torch step pre-hook (:func:`torch_step_pre_hook`)."""
        return torch_step_pre_hook(opt, hook)

    def fingerprint(self, key: str, opt: torch.optim.Optimizer, ctx: AdapterContext) -> Hashable | None:
        """The parameters, their names and state tensors (:func:`~shardpoint.adapters.reuse.optimizer_fingerprint`)."""
        return optimizer_fingerprint(opt, ctx)

    def refresh(self, key: str, opt: torch.optim.Optimizer, part: SavePart, ctx: AdapterContext) -> SavePart:
        """The kept part with the hyper-parameters encoded afresh."""
        return refresh_groups(key, opt, part, ctx)

    def load(self, key, opt, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>") -> LoadPart:
        return _OptimizerLoad(key, opt, doc, tensors, ctx, where).plan()

    def logical_value(self, key: str, value: Any, rules: Sequence[Any]) -> Any:
        """The document with per-parameter entries under the layout rules' logical names."""
        return optimizer_doc_to_logical(key, value, rules)

    def read_value(self, key: str, opt: Any, doc: Any, ctx: AdapterContext, rules: Sequence[Any], where: str) -> Any:
        """The document in this optimizer's own naming.

        A document keyed the way ``get_optimizer_state_dict`` keys it (state
        by the model's parameter names) is viewed in the optimizer's naming;
        under layout rules its logical names become the target's physical ones.
        """
        if is_dcp_optimizer_doc(doc):
            doc = dcp_to_native(doc, param_names(opt, ctx), where)
        if rules:
            check_optimizer_doc(doc, f"{where}: entry {key!r}")
            doc = optimizer_doc_to_physical(key, doc, rules, ctx.param_names.values())
        return doc


class _OptimizerLoad:
    """One optimizer's load: which saved state goes to which live parameter, and the groups' hyper-parameters."""

    def __init__(self, key, opt, doc, tensors: Mapping[str, Any], ctx, where: str):
        self.key, self.opt, self.tensors, self.ctx, self.where = key, opt, tensors, ctx, where
        self.part = LoadPart()
        self.saved_state, self.saved_groups, self.group_of = check_optimizer_doc(doc, f"{where}: entry {key!r}")
        self.new_state: dict[int, tuple[torch.Tensor, Any]] = {}
        self.cleared: list[torch.Tensor] = []
        self.seen: set[str] = set()
        self.decoded_groups: list[tuple[dict, Any]] = []

    def plan(self) -> LoadPart:
        """Match every live parameter to its saved state and group; the part installs them in ``finish``."""
        group_updates = []
        for gi, g in enumerate(self.opt.param_groups):
            sgi = None
            for i, p in enumerate(g["params"]):
                found = self._param(gi, i, p)
                if sgi is None:
                    sgi = found
            sgi = gi if sgi is None else sgi
            if sgi < len(self.saved_groups):
                group_updates.append((g, self.saved_groups[sgi]))
            else:
                self.part.missing.append(f"{self.key}.groups.{gi}")
        self.part.unexpected.extend(f"{self.key}.state.{name}" for name in self.saved_state if name not in self.seen)
        # Hyper-parameters may hold tensors (e.g. a tensor lr): decode them now so targets exist.
        for g, gdoc in group_updates:
            self.decoded_groups.append((g, decode_value(gdoc, self._group_tensor, self.ctx.allow_pickle, self.where)))
        self.part.finish = self._install
        opt = self.opt
        self.part.landed = lambda targets: unlanded(targets, live_storages(optimizer_tensors(opt)))
        return self.part

    def _param(self, gi: int, i: int, p: torch.Tensor) -> int | None:
        """Plan ``p``'s state; return the saved group its name belongs to, if known."""
        views = self.ctx.views.get(id(p))
        if views is not None:
            sgi = None
            for v in views:
                self.seen.add(v.fqn)
                if sgi is None and v.fqn in self.group_of:
                    sgi = self.group_of[v.fqn]
            got = _load_views(self.key, p, views, self.saved_state, self.group_of, self.tensors, self.part, self.ctx, self.where)
            if got is None:
                self.cleared.append(p)
            else:
                self.new_state[id(p)] = (p, got)
            return sgi
        name = param_name(self.key, p, gi, i, self.ctx)
        self.seen.add(name)
        sgi = self.group_of.get(name)
        if name not in self.saved_state:
            # A parameter the saved optimizer knew but held no state for (never got a
            # gradient) is fine; one it never knew is missing.
            if name not in self.group_of:
                self.part.missing.append(f"{self.key}.state.{name}")
            self.cleared.append(p)
            return sgi
        prefix = f"{self.key}.state.{name}."
        state = decode_value(self.saved_state[name], lambda fqn: self._state_tensor(fqn, p, prefix), self.ctx.allow_pickle, self.where)
        self.new_state[id(p)] = (p, state)
        return sgi

    def _state_tensor(self, fqn: str, p: torch.Tensor, prefix: str) -> torch.Tensor | None:
        """The tensor a saved state entry ``fqn`` of ``p`` loads into (reused in place where it can be)."""
        meta = self.tensors.get(fqn)
        if meta is None:
            self.part.missing.append(fqn)
            return None
        self.part.consumed.add(fqn)
        dt = torch_dtype(meta.dtype)
        shard = self.ctx.shards.get(id(p))
        if shard is not None and tuple(meta.shape) == shard.shape:  # sharded like p (Megatron TP)
            dest = torch.zeros_like(p.detach(), dtype=dt)
            self.part.targets.extend(shard.targets(fqn, dest))
            return dest
        field = fqn[len(prefix):] if fqn.startswith(prefix) else None
        dest = reusable_state(self.opt.state.get(p), field, p, tuple(meta.shape), dt)
        if dest is None:
            dest = empty_like_target(p, tuple(meta.shape), dt)
        if dest.dtype != dt:
            raise ShapeMismatchError(f"{self.where}: tensor {fqn!r}: cannot allocate {meta.dtype}, got {dtype_name(dest.dtype)}")
        tgt = load_target(fqn, dest)
        if tgt is not None:
            self.part.targets.append(tgt)
        return dest

    def _group_tensor(self, fqn: str) -> torch.Tensor | None:
        meta = self.tensors.get(fqn)
        if meta is None:
            self.part.missing.append(fqn)
            return None
        self.part.consumed.add(fqn)
        dest = empty_like_target(None, tuple(meta.shape), torch_dtype(meta.dtype)).zero_()
        self.part.targets.append(load_target(fqn, dest))
        return dest

    def _install(self):
        opt = self.opt
        for p in self.cleared:  # the checkpoint had no state for it: drop stale state
            opt.state.pop(p, None)
        for p, s in self.new_state.values():
            opt.state[p] = s
        # Keys that name the live run's own groups (declared by the adapters in the context) stay.
        live = self.ctx.live_group_keys.get(id(opt), frozenset())
        for g, hyper in self.decoded_groups:
            for k, v in hyper.items():
                if k != "params" and k not in live:
                    g[k] = v
        return opt


def reusable_state(current: Any, field: str | None, p: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The optimizer's current state tensor ``field`` of ``p`` if the load can fill it in place, else None.

    In place means no second copy of the optimizer state while the load runs
    (the old state stays referenced until the new one is installed) and no
    page faults on fresh memory. Only a tensor exactly like the one the load
    would allocate qualifies: same global shape and dtype, a plain tensor on
    ``p``'s device for a plain ``p``, a DTensor on ``p``'s mesh with ``p``'s
    placements for a DTensor ``p``.
    """
    if field is None or not isinstance(current, Mapping):
        return None
    t = current.get(field)
    if not isinstance(t, torch.Tensor) or t.requires_grad or tuple(t.shape) != shape or t.dtype != dtype:
        return None
    if tuple(p.shape) != shape:
        return None  # state not shaped like p (a scalar step) is allocated as usual
    if is_dtensor(p):
        if not is_dtensor(t) or t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
            return None
        local, plocal = local_shard(t), local_shard(p)
        if tuple(local.shape) != tuple(plocal.shape):
            return None
    elif is_dtensor(t) or t.device != p.device:
        return None
    else:
        local, plocal = t, p
    if not local.is_contiguous() or local.untyped_storage().data_ptr() == plocal.untyped_storage().data_ptr():
        return None  # not laid out like a fresh tensor, or the parameter itself
    return t  # needs no grad (checked above): the state keeps its own tensor object


def _on_state(p, ctx: AdapterContext, on_tensor, part: SavePart):
    """The tensor callback for ``p``'s state: state shaped like a framework-sharded ``p`` follows its shard."""
    shard = ctx.shards.get(id(p))  # a framework-sharded parameter (Megatron TP)
    if shard is None:
        return on_tensor

    def cb(fqn, t):
        if tuple(t.shape) == tuple(p.shape) and (t.dim() > 0 or fqn.rpartition(".")[2] not in _SCALAR_STATE):
            part.tensors.extend(shard.save(fqn, t))
        else:  # scalar state (``step``): held by every rank of the parameter's stage
            part.tensors.extend(shard.save_whole(fqn, t))

    return cb


def _append(out: list, item) -> None:
    if item is not None:
        out.append(item)


def _per_element(meta_shape: tuple[int, ...], suffix: str, v: ParamView) -> bool:
    """Whether saved state ``suffix`` of ``v`` is shaped like the parameter (split into pieces)."""
    if tuple(meta_shape) != tuple(v.shape):
        return False
    return len(v.shape) > 0 or suffix not in _SCALAR_STATE


def _view_piece(fqn: str, t: torch.Tensor, p: torch.Tensor, v: ParamView) -> SaveTensor | None:
    """This rank's piece of state tensor ``t`` of packed parameter ``p`` for original parameter ``v``."""
    t = t.detach()
    if is_dtensor(t):
        raise UnsupportedStateError(f"{fqn}: DTensor state on a flat parameter is not supported")
    if tuple(t.shape) == tuple(p.shape) and p.numel() > 0:
        lo, n = v.local
        data = t.reshape(-1)[lo : lo + n]
        return SaveTensor(
            fqn, data, v.shape, v.box, v.flat, v.replica[0], v.replica[1], float(n * data.element_size()), "fsdp1"
        )
    # Scalar (or otherwise shaped) state: one value per original parameter, the same on every
    # rank holding a piece of it. Those ranks hold different sets of parameters, so the
    # balanced writer choice (which assumes replicas list the same tensors) does not apply:
    # the first holder writes it.
    if v.holders[0] != 0:
        return None
    shape = tuple(int(x) for x in t.shape)
    return SaveTensor(fqn, t, shape, Box.full(shape), None, 0, 1, float(t.numel() * t.element_size()), "replicated")


def _load_views(key, p, views, saved_state, group_of, tensors, part: LoadPart, ctx: AdapterContext, where):
    """Reassemble the state of packed parameter ``p`` from its original parameters' saved state.

    Returns the new state dict, or ``None`` when ``p`` should hold no state
    (nothing saved, or this rank holds none of it under ``use_orig_params``).
    """
    present = [v for v in views if v.fqn in saved_state]
    for v in views:
        if v.fqn not in saved_state and v.fqn not in group_of:
            part.missing.append(f"{key}.state.{v.fqn}")
    install = bool(present) and p.numel() > 0
    pieces: dict[str, torch.Tensor] = {}
    scalars: dict[str, torch.Tensor] = {}
    combined: dict = {}
    for v in present:
        prefix = f"{key}.state.{v.fqn}."

        def get_tensor(fqn, v=v, prefix=prefix):
            meta = tensors.get(fqn)
            if meta is None:
                part.missing.append(fqn)
                return None
            part.consumed.add(fqn)
            if not install:
                return None
            suffix = fqn[len(prefix):] if fqn.startswith(prefix) else fqn
            dt = torch_dtype(meta.dtype)
            if _per_element(tuple(meta.shape), suffix, v):
                dest = pieces.get(suffix)
                if dest is None:
                    dest = pieces[suffix] = torch.zeros_like(p.detach(), dtype=dt)
                if dest.dtype != dt:
                    raise ShapeMismatchError(f"{where}: tensor {fqn!r}: dtype {meta.dtype} differs from other pieces")
                if v.flat is not None:
                    lo, n = v.local
                    if n != v.flat[1] - v.flat[0]:
                        raise ShapeMismatchError(f"{where}: tensor {fqn!r}: view of {n} elements for flat range {v.flat}")
                    part.targets.append(LoadTarget(fqn, dest.reshape(-1)[lo : lo + n], v.shape, v.box, v.flat))
                return dest
            dest = scalars.get(suffix)
            if dest is None:  # one copy serves every original parameter of ``p``
                dest = scalars[suffix] = empty_like_target(None, tuple(meta.shape), dt).zero_()
                part.targets.append(LoadTarget(fqn, dest, tuple(meta.shape), Box.full(meta.shape)))
            return dest

        decoded = decode_value(saved_state[v.fqn], get_tensor, ctx.allow_pickle, where)
        if install and isinstance(decoded, dict):
            for k, val in decoded.items():
                combined.setdefault(k, val)
    return combined if install else None
