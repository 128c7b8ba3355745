"""What adapters produce and consume: tensors with geometry, and load targets.

An adapter turns one entry of the user's ``state`` into
:class:`SaveTensor` items (local data plus where it sits in the global tensor)
and JSON-safe values, and on load into :class:`LoadTarget` items (local
tensors to fill in place) plus a ``finish`` callback that installs the result.
The rest of shardpoint never imports a framework. :class:`SaveTensor`,
:class:`LoadTarget` and the dtype names are defined in :mod:`shardpoint.items`
(the engine uses them too) and re-exported here.
"""

from __future__ import annotations

import abc
import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from ..errors import UnsupportedStateError, mismatch_error
from ..geometry import Box
from ..items import LoadTarget, SaveTensor, dtype_name, torch_dtype

__all__ = [
    "SaveTensor",
    "LoadTarget",
    "SavePart",
    "LoadPart",
    "AdapterContext",
    "ContextFacts",
    "ParamShard",
    "ParamView",
    "Replicas",
    "Adapter",
    "match_replicas",
    "dtype_name",
    "torch_dtype",
]


@dataclass
class SavePart:
    """What one state entry contributes to a save."""

    tensors: list[SaveTensor] = field(default_factory=list)
    value: Any = None  # JSON-safe document stored under the entry's key
    framework: str = ""


@dataclass
class LoadPart:
    """What one state entry needs from a load, and how to install it.

    ``finish()`` runs after every target is filled and returns the entry's new
    value (the same object for in-place restores). ``missing``/``unexpected``
    list tensor names for strict checking. ``landed(targets)`` runs after
    ``finish`` with the targets as the load used them and names those whose
    data did not reach the live state (see :mod:`shardpoint.adapters.landing`);
    ``None`` means the loader checks that every target aliases a tensor of
    the entry's new value.
    """

    targets: list[LoadTarget] = field(default_factory=list)
    finish: Callable[[], Any] = lambda: None
    landed: Callable[[list[LoadTarget]], list[str]] | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    consumed: set[str] = field(default_factory=set)

    def expect(self, tensors: Mapping[str, Any], fqn: str, shape: tuple[int, ...], dtype: torch.dtype, where: str):
        """The checkpoint's entry for ``fqn``, checked against the target's global shape and dtype.

        Records ``fqn`` as missing (returns ``None``) or consumed; a differing
        shape or dtype raises :class:`ShapeMismatchError` (:class:`DtypeMismatchError` for the dtype alone) naming both.
        """
        meta = tensors.get(fqn)
        if meta is None:
            self.missing.append(fqn)
            return None
        self.consumed.add(fqn)
        if tuple(meta.shape) != tuple(shape) or torch_dtype(meta.dtype) != dtype:
            raise mismatch_error(where, fqn, (meta.dtype, meta.shape), (dtype_name(dtype), shape))
        return meta


@dataclass(frozen=True)
class ParamView:
    """Where one original parameter lies inside a local tensor that holds several.

    An FSDP1 ``FlatParameter`` shard (or a ``use_orig_params`` 1-D view of it)
    holds a flat range ``flat`` of the parameter ``fqn`` (global ``shape``,
    row-major order), stored at elements ``[local[0], local[0] + local[1])``
    of the local tensor. ``flat`` is ``None`` when this rank holds none of it.
    ``replica`` is (index, count) among ranks holding the same piece;
    ``holders`` is (index, count) among ranks holding any piece of the
    parameter, which is where its scalar optimizer state (``step``) lives.
    """

    fqn: str
    shape: tuple[int, ...]
    flat: tuple[int, int] | None
    local: tuple[int, int] = (0, 0)
    replica: tuple[int, int] = (0, 1)
    holders: tuple[int, int] = (0, 1)

    @property
    def box(self) -> Box:
        return Box.full(self.shape)


class ParamShard(abc.ABC):
    """Where a parameter's local tensor lies in its global tensor, so that state shaped like it follows it.

    A framework that keeps parameters as plain local tensors of a larger
    global one (Megatron's tensor-parallel layers) describes each with a
    subclass; the optimizer adapter saves and loads the parameter's state
    through it. ``shape`` is the global shape.

    Example (a row-sharded parameter: this rank holds rows ``lo:lo + n``)::

        class RowShard(ParamShard):
            def __init__(self, shape, lo, n):
                self.shape, self.lo, self.n = shape, lo, n

            def save(self, fqn, t):
                box = Box((self.lo, 0), (self.n, self.shape[1]))
                return [SaveTensor(fqn, t.detach(), self.shape, box)]

            def save_whole(self, fqn, t):
                return [SaveTensor(fqn, t.detach(), tuple(t.shape), Box.full(tuple(t.shape)))]

            def targets(self, fqn, dest):
                return [LoadTarget(fqn, dest, self.shape, Box((self.lo, 0), (self.n, self.shape[1])))]
    """

    shape: tuple[int, ...]

    @abc.abstractmethod
    def save(self, fqn: str, t: torch.Tensor) -> list[SaveTensor]:
        """:class:`SaveTensor` items for ``t`` (the local tensor, or state shaped like it)."""

    @abc.abstractmethod
    def save_whole(self, fqn: str, t: torch.Tensor) -> list[SaveTensor]:
        """A tensor held whole, the same on every rank holding a piece of the parameter (a scalar ``step``)."""

    @abc.abstractmethod
    def targets(self, fqn: str, dest: torch.Tensor) -> list[LoadTarget]:
        """:class:`LoadTarget` items that fill ``dest`` (shaped like the local tensor) in place."""


@dataclass(frozen=True)
class ContextFacts:
    """What an adapter knows about one entry of the state that other adapters of the same save or load need.

    ``names`` maps ``id(param)`` to the parameter's name in the checkpoint
    (the optimizer adapter keys state by it), ``views`` maps ``id(param)``
    of a tensor that packs several parameters to where each lies in it
    (:class:`ParamView`), ``shards`` maps ``id(param)`` to a
    :class:`ParamShard` for a parameter that is a plain local piece of a
    larger tensor, and ``live_group_keys`` maps ``id(optimizer)`` to
    param-group keys that describe the live run (a load keeps their live
    values). See :meth:`Adapter.context_facts`.

    Example::

        ContextFacts(names={id(p): f"{key}.{n}" for n, p in module.named_parameters()})
    """

    names: Mapping[int, str] = field(default_factory=dict)
    views: Mapping[int, tuple[ParamView, ...]] = field(default_factory=dict)
    shards: Mapping[int, ParamShard] = field(default_factory=dict)
    live_group_keys: Mapping[int, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Replicas:
    """The ranks that hold identical copies of an entry's plain tensors.

    ``ranks`` are global ranks (``None``: every rank of the group); this rank
    is copy ``index`` of ``count``.
    """

    index: int
    count: int
    ranks: frozenset[int] | None = None


@dataclass
class AdapterContext:
    """Facts every adapter may need: ranks, and parameter names across the state.

    ``views`` maps ``id(param)`` of a parameter that packs several original
    parameters (an FSDP1 flat parameter, or one of its ``use_orig_params``
    views) to where each original parameter lies in it; the optimizer adapter
    splits such a parameter's state into per-original-parameter pieces.
    ``replicas`` maps a state key to the ranks holding copies of its plain
    tensors (``sp.save(..., replicated_over=...)``); keys not listed are
    replicated over the whole group. ``live_group_keys`` maps
    ``id(optimizer)`` to param-group keys that describe the live run, not
    hyper-parameters (the name a framework looks a group's process groups up
    by): a load keeps their live values instead of restoring the saved ones.
    ``shards`` maps ``id(param)`` of a parameter that is a plain local piece
    of a larger tensor to its :class:`ParamShard`; the parameter's optimizer
    state follows it. Every adapter contributes these facts for the entries
    it knows (:meth:`Adapter.context_facts`).
    """

    rank: int
    world: int
    param_names: Mapping[int, str]
    allow_pickle: bool = False
    views: Mapping[int, tuple[ParamView, ...]] = field(default_factory=dict)
    replicas: Mapping[str, Replicas] = field(default_factory=dict)
    patterns: tuple[tuple[str, Replicas | None], ...] = ()
    live_group_keys: Mapping[int, frozenset[str]] = field(default_factory=dict)
    shards: Mapping[int, ParamShard] = field(default_factory=dict)

    def _replicas(self, fqn: str | None) -> Replicas | None:
        if fqn is None:
            return None
        if self.patterns:
            found, r = match_replicas(self.patterns, fqn)
            if found:
                return r
        if not self.replicas:
            return None
        return self.replicas.get(fqn.split(".", 1)[0])

    def plain_replica(self, fqn: str | None = None) -> tuple[int, int]:
        """(index, count) of this rank's copy of the plain (non-DTensor) tensor ``fqn``.

        By default a plain tensor is identical on every rank of the group; a
        ``replicated_over`` declaration for its entry narrows that group.
        """
        r = self._replicas(fqn)
        if r is None:
            return self.rank, self.world
        return r.index, r.count

    def replica_ranks(self, fqn: str | None = None) -> frozenset[int] | None:
        """Global ranks that may hold copies of ``fqn`` (``None``: no restriction)."""
        r = self._replicas(fqn)
        return None if r is None else r.ranks

    def replica_group(self, fqn: str | None = None) -> str:
        """A name for the replica group of ``fqn``, the same on every rank of that group."""
        ranks = self.replica_ranks(fqn)
        return "" if ranks is None else ",".join(str(r) for r in sorted(ranks))


def match_replicas(patterns, fqn: str) -> tuple[bool, Replicas | None]:
    """The first ``(pattern, replicas)`` pair whose pattern matches ``fqn``: (found, replicas).

    A pattern matches a tensor's fully qualified name (fnmatch rules), the
    name's tail after a dot (as layout rules match: ``"experts.*"`` matches
    ``model.experts.0.w``), or a prefix of it ending at a dot; for optimizer state
    (``<entry>.state.<param>.<name>``) it may match the parameter's name
    instead, so moments follow their parameter's declaration.

    Example::

        match_replicas((("model.experts.*", r),), "optim.state.model.experts.0.w.exp_avg")  # (True, r)
    """
    names = [fqn]
    i = fqn.find(".state.")
    if i >= 0:
        param = fqn[i + len(".state."):].rpartition(".")[0]
        if param:
            names.append(param)
    for pattern, r in patterns:
        for n in names:
            if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, "*." + pattern) or n.startswith(pattern + "."):
                return True, r
    return False, None


class Adapter(abc.ABC):
    """One framework's bridge between its objects and shardpoint's tensors with geometry.

    A save and a load ask, for each entry of the state, the first registered
    adapter whose :meth:`claims` accepts the object (see
    :func:`shardpoint.adapters.register_adapter` for the order). The adapter
    then turns the object into a :class:`SavePart` on save and a
    :class:`LoadPart` on load; nothing else in shardpoint knows the framework.
    ``name`` names the adapter in the registry and in the checkpoint's
    summary of which framework saved each entry. The other methods are
    abilities with defaults, overridden only where the framework needs them:
    :meth:`logical_value` and :meth:`read_value` (a saved value that names
    tensors), :meth:`fingerprint` and :meth:`refresh` (reusing a part from
    save to save), :meth:`context_facts` (parameter names, packed-parameter
    views, per-parameter shards and live param-group keys that other
    adapters need), :meth:`implied_rules` (layout rules the framework implies
    for the state, asked where :meth:`may_imply_rules` says so), and :meth:`is_stepped`, :meth:`step_updates` and
    :meth:`add_step_pre_hook` (what an optimizer's step updates, which a
    lazy asynchronous save copies in the background, fenced before the next
    step).

    Example::

        class CounterAdapter(Adapter):
            name = "counter"

            def claims(self, obj):
                return isinstance(obj, Counter)

            def save(self, key, obj, ctx):
                return SavePart(value={"count": obj.count}, framework=self.name)

            def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>"):
                def finish():
                    obj.count = doc["count"]
                    return obj
                return LoadPart(finish=finish, landed=lambda targets: [])
    """

    name: str = ""

    @abc.abstractmethod
    def claims(self, obj: Any) -> bool:
        """Whether this adapter saves and loads ``obj``."""

    @abc.abstractmethod
    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        """The tensors and JSON-safe value that ``state[key] = obj`` contributes to a save."""

    @abc.abstractmethod
    def load(self, key: str, obj: Any, doc: Any, tensors: Mapping[str, Any], ctx: AdapterContext,
             where: str = "<checkpoint>") -> LoadPart:
        """The targets to fill for ``state[key] = obj`` and how to install them.

        ``doc`` is the value saved under ``key`` (``None`` if absent),
        ``tensors`` the checkpoint's tensor entries by name, and ``where``
        names the checkpoint in error messages.
        """

    def logical_value(self, key: str, value: Any, rules: Sequence[Any]) -> Any:
        """The value :meth:`save` returned for ``key``, named as the layout rules ``rules`` name tensors.

        A save under layout rules stores logical tensor names; an adapter
        whose value names tensors (an optimizer's per-parameter state) renames
        them here. By default the value names no tensors and is unchanged.
        """
        return value

    def read_value(self, key: str, obj: Any, doc: Any, ctx: AdapterContext, rules: Sequence[Any], where: str) -> Any:
        """The saved value ``doc`` of ``key`` as this adapter's :meth:`load` reads it.

        The inverse of :meth:`logical_value` under layout rules ``rules``, and
        any other view the adapter accepts (the optimizer adapter reads a
        document keyed the way ``get_optimizer_state_dict`` keys it). By
        default ``doc`` is read as saved.
        """
        return doc

    def fingerprint(self, key: str, obj: Any, ctx: AdapterContext) -> Hashable | None:
        """What :meth:`save` builds ``obj``'s part from, for a repeated save to compare.

        A saver reuses the part, context facts and live tensors kept with it
        while the next save's is equal (:class:`~shardpoint.saving.reuse.SaveCache`),
        so it changes whenever :meth:`save`, :meth:`context_facts` or
        :meth:`step_updates` would give something else. By default: ``None``.
        """
        return None

    def refresh(self, key: str, obj: Any, part: SavePart, ctx: AdapterContext) -> SavePart:
        """A reused ``part`` of ``obj``, brought up to date with what its fingerprint leaves out.

        The optimizer adapter encodes its hyper-parameters afresh here (a
        scheduler changes ``lr`` every step). By default ``part`` is returned.
        """
        return part

    def context_facts(self, key: str, obj: Any, state: Mapping[str, Any]) -> ContextFacts | None:
        """What this adapter knows about ``state[key] = obj`` that other adapters need, or ``None``.

        :func:`~shardpoint.adapters.build_context` asks the registered
        adapters in order for each entry; the first answer that is not
        ``None`` gives the entry's :class:`ContextFacts`, and an earlier entry
        keeps a parameter it already named. An adapter answers for the
        objects it handles, and may answer for one another adapter claims
        when its framework shapes that object (the DeepSpeed adapter declares
        the live param-group keys of a torch optimizer over its MoE groups).
        ``state`` is the whole state, for facts that pair entries (a module
        and the optimizer that holds its master weights). By default there
        are none.

        Example::

            def context_facts(self, key, obj, state):
                if not isinstance(obj, MyModel):
                    return None
                return ContextFacts(names={id(p): f"{key}.{n}" for n, p in obj.named_parameters()})
        """
        return None

    def may_imply_rules(self, state: Mapping[str, Any]) -> bool:
        """Whether :meth:`implied_rules` may give rules for ``state``; only then is it asked.

        A yes makes the save's ranks agree before the write, also the rank
        whose :meth:`implied_rules` then fails, so the answer must be cheap,
        never fail, and be the same on every rank: read only what all share
        (imported frameworks, the state's entry types). By default: whether
        :meth:`implied_rules` is overridden. Example::

            def may_imply_rules(self, state):
                return any(isinstance(m, MyMoE) for m in state.values())
        """
        return type(self).implied_rules is not Adapter.implied_rules

    def implied_rules(self, state: Mapping[str, Any]) -> list[Any]:
        """The layout rules this adapter's framework implies for ``state``, applied with the user's.

        Asked on save and load where :meth:`may_imply_rules` says yes
        (:func:`~shardpoint.adapters.implied_rules`). The DeepSpeed adapter
        returns an :class:`~shardpoint.layouts.Experts` rule for each MoE
        layer, so that local experts are stored at their global index. By
        default there are none.

        Example::

            def implied_rules(self, state):
                return [sp.Experts(f"{k}.experts", num_experts=8, group=ep_group)
                        for k, m in state.items() if isinstance(m, MyMoE)]
        """
        return []

    def is_stepped(self, obj: Any) -> bool:
        """Whether ``obj`` changes tensors of the state only inside a step that a hook can precede.

        An optimizer is: a lazy asynchronous save copies what its step
        updates (:meth:`step_updates`) after the call returns, and fences the
        save in a hook that runs before its next step
        (:meth:`add_step_pre_hook`). Every adapter is asked, so the answer
        must be cheap, and it counts only from the adapter that claims
        ``obj``. By default no: everything of ``obj`` is copied in the call.

        Example::

            def is_stepped(self, obj):
                return isinstance(obj, SignSGD)
        """
        return False

    def step_updates(self, key: str, obj: Any, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """``(name, live tensor)`` for each tensor the step of ``state[key] = obj`` updates, in update order.

        Names are those the save stores the tensors under (a parameter's
        name in ``ctx.param_names``, a state tensor's name as :meth:`save`
        makes it); tensors are the live objects in-place changes go through,
        whose version counters witness a change before the fence. Asked
        only when :meth:`is_stepped`. By default none.

        Example::

            def step_updates(self, key, opt, ctx):
                out = []
                for p in opt.params:
                    name = ctx.param_names[id(p)]
                    out += [(name, p), (f"{key}.momentum.{name}", opt.momentum[id(p)])]
                return out
        """
        return []

    def steps_in_graph(self, obj: Any) -> bool:
        """Whether a step of ``obj`` may run inside a captured device graph, where no hook runs.

        A replayed graph calls no step pre-hook and bumps no version
        counter, so a lazy save could not be fenced before such a step: it is
        taken eagerly instead. Asked only when :meth:`is_stepped`. By default no.

        Example::

            def steps_in_graph(self, opt):
                return opt.capturable
        """
        return False

    def add_step_pre_hook(self, obj: Any, hook: Callable[[], None]) -> Any:
        """Have ``obj`` call ``hook()`` before each of its steps; return a handle whose ``remove()`` undoes it.

        Asked only when :meth:`is_stepped`; an adapter that declares its
        objects stepped says here how to hook their step.

        Example::

            def add_step_pre_hook(self, opt, hook):
                return opt.register_step_pre_hook(lambda o, args, kwargs: hook())
        """
        raise UnsupportedStateError(
            f"adapter {self.name!r} declares {type(obj).__qualname__} stepped (is_stepped) but cannot hook its "
            "step; override add_step_pre_hook, or return False from is_stepped so that it is copied in the call"
        )


def global_cost(shape: tuple[int, ...], itemsize: int, replica_count: int, mesh_size: int) -> float:
    """Size estimate of one chunk computed only from global facts (same on every rank)."""
    return math.prod(shape) * itemsize * replica_count / max(1, mesh_size)
