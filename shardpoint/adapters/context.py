"""Build the :class:`AdapterContext` for one save or load from the user's state.

Parameter names, packed-parameter views (see
:class:`~shardpoint.adapters.base.ParamView`), per-parameter shards and live
param-group keys come from the registered adapters
(:meth:`~shardpoint.adapters.Adapter.context_facts`): the modules' own
names, wrapper prefixes removed, so optimizer state is keyed by the same
names as the model. ``replicated_over`` says which ranks hold identical
copies of plain tensors, for layouts where that is not the whole group
(pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .base import Adapter, AdapterContext, ParamShard, ParamView, Replicas
from .registry import default_adapters

__all__ = ["StateFacts", "gather_facts", "build_context", "may_imply_rules", "implied_rules", "resolve_replicas", "resolve_patterns", "is_name_pattern"]


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _one(spec: Any, what: str) -> Replicas | None:
    if spec is None:
        return None
    if isinstance(spec, Replicas):
        return spec
    me = _global_rank()
    if isinstance(spec, (list, tuple, range, set, frozenset)):
        ranks = sorted(int(r) for r in spec)
    else:  # a ProcessGroup (or a DeviceMesh)
        import torch.distributed as dist

        group = spec.get_group() if hasattr(spec, "get_group") and not isinstance(spec, dist.ProcessGroup) else spec
        ranks = sorted(dist.get_process_group_ranks(group))
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"replicated_over{what}: expected distinct global ranks, got {ranks}")
    if me not in ranks:
        raise ValueError(
            f"replicated_over{what}: rank {me} is not among the ranks {ranks}; each rank passes the "
            "group of ranks that hold the same copy as itself"
        )
    return Replicas(ranks.index(me), len(ranks), frozenset(ranks))


def is_name_pattern(key: Any) -> bool:
    """Whether a ``replicated_over`` key is a pattern over tensor names rather than a state key.

    Patterns hold a dot or a glob character: ``"model.experts.*"``, ``"*"``.
    """
    return isinstance(key, str) and any(c in key for c in ".*?[")


def _pairs(replicated_over: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(replicated_over, Mapping):
        return list(replicated_over.items())
    if isinstance(replicated_over, (list, tuple)) and replicated_over and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in replicated_over
    ):
        return list(replicated_over)
    return None


def resolve_patterns(replicated_over: Any) -> tuple[tuple[str, Replicas | None], ...]:
    """The ``replicated_over`` entries keyed by patterns over tensor names, in order (``None``: every rank).

    Example::

        resolve_patterns({"model.experts.*": [0, 1], "*": None})
    """
    pairs = _pairs(replicated_over) or []
    return tuple((k, _one(v, f"[{k!r}]")) for k, v in pairs if is_name_pattern(k))


def resolve_replicas(replicated_over: Any, keys: Sequence[str]) -> dict[str, Replicas]:
    """Per state key, the replica group of its plain tensors (keys left out: the whole group).

    ``replicated_over`` is ``None``, a process group, a 1-D device mesh, a
    sequence of global ranks, or a mapping (or list of pairs) from state keys
    or patterns over tensor names to any of these; patterns are resolved by
    :func:`resolve_patterns`.
    """
    if replicated_over is None:
        return {}
    pairs = _pairs(replicated_over)
    if pairs is not None:
        plain = {k: v for k, v in pairs if not is_name_pattern(k)}
        unknown = sorted(set(plain) - set(keys))
        if unknown:
            raise ValueError(f"replicated_over names state keys {unknown} that are not in the state")
        out = {}
        for k, v in plain.items():
            r = _one(v, f"[{k!r}]")
            if r is not None:
                out[k] = r
        return out
    r = _one(replicated_over, "")
    return {k: r for k in keys}


@dataclass(frozen=True)
class StateFacts:
    """The entries' :class:`ContextFacts` of one state, merged, and which adapter gave each entry's.

    ``answered`` maps each state key to the adapter whose
    :meth:`~shardpoint.adapters.Adapter.context_facts` answered for it
    (``None``: none did). A saver keeps these across saves: while every
    entry that gave facts is the same object, claimed by the adapter that
    gave them, with an unchanged fingerprint, they are the same facts
    (:mod:`shardpoint.saving.prepare`).

    Example::

        facts = gather_facts({"model": model, "optimizer": opt})
        facts.answered["model"].name  # 'module'
    """

    names: Mapping[int, str]
    views: Mapping[int, tuple[ParamView, ...]]
    shards: Mapping[int, ParamShard]
    live: Mapping[int, frozenset[str]]
    answered: Mapping[str, Adapter | None]

    def context(self, rank: int, world: int, allow_pickle: bool = False, replicated_over: Any = None,
                keys: Sequence[str] = ()) -> AdapterContext:
        """The :class:`AdapterContext` of these facts for one save or load (``keys``: the state's, for ``replicated_over``).

        Example::

            ctx = facts.context(rank=0, world=1)
        """
        return AdapterContext(
            rank, world, self.names, allow_pickle, self.views, resolve_replicas(replicated_over, list(keys)),
            resolve_patterns(replicated_over), self.live, self.shards,
        )


def gather_facts(state: Mapping[str, Any], adapters: Sequence[Adapter] | None = None) -> StateFacts:
    """Every entry's facts, from the first of ``adapters`` (default: the registered ones) that answers for it.

    A parameter named by an earlier entry keeps that name.

    Example::

        gather_facts({"model": model}).names[id(model.weight)]  # 'model.weight'
    """
    adapters = default_adapters() if adapters is None else adapters
    names: dict[int, str] = {}
    views: dict[int, tuple[ParamView, ...]] = {}
    shards: dict[int, ParamShard] = {}
    live: dict[int, frozenset[str]] = {}
    answered: dict[str, Adapter | None] = {}
    for key, obj in state.items():
        answered[key], facts = next(((a, f) for a in adapters if (f := a.context_facts(key, obj, state)) is not None), (None, None))
        if facts is None:
            continue
        for i, name in facts.names.items():
            names.setdefault(i, name)
        for i, v in facts.views.items():
            views.setdefault(i, v)
        for i, sh in facts.shards.items():
            shards.setdefault(i, sh)
        for i, ks in facts.live_group_keys.items():
            live[i] = live.get(i, frozenset()) | ks
    return StateFacts(names, views, shards, live, answered)


def build_context(
    state: Mapping[str, Any], rank: int, world: int, allow_pickle: bool = False, replicated_over: Any = None
) -> AdapterContext:
    """The context every adapter of one save or load sees.

    Each entry's facts come from the first registered adapter that answers
    :meth:`~shardpoint.adapters.Adapter.context_facts` for it; a parameter
    named by an earlier entry keeps that name.

    Example::

        ctx = build_context({"model": model, "optimizer": opt}, rank=0, world=1)
        ctx.param_names[id(model.weight)]  # 'model.weight'
    """
    return gather_facts(state).context(rank, world, allow_pickle, replicated_over, list(state))


def may_imply_rules(state: Mapping[str, Any]) -> bool:
    """Whether a registered adapter may imply layout rules for ``state``: the same answer on every rank.

    A save asks it before :func:`implied_rules` to decide whether its ranks
    agree before the write (:meth:`~shardpoint.adapters.Adapter.may_imply_rules`).

    Example::

        declared = bool(user_rules) or may_imply_rules(state)
    """
    return any(adapter.may_imply_rules(state) for adapter in default_adapters())


def implied_rules(state: Mapping[str, Any]) -> list[Any]:
    """The layout rules the frameworks in ``state`` imply, from every registered adapter that may imply some, in order.

    A save and a load apply them after the user's own rules
    (:meth:`~shardpoint.adapters.Adapter.implied_rules`; experts of a MoE
    layer stored at their global index, for one).

    Example::

        rules = [*user_rules, *implied_rules(state)]
    """
    return [rule for adapter in default_adapters() if adapter.may_imply_rules(state) for rule in adapter.implied_rules(state)]
