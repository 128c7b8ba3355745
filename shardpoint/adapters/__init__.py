"""Adapters: one per framework, tried in registry order; the first that claims an object handles it.

Every adapter subclasses :class:`Adapter` (``claims``, ``save``, ``load``).
The registry (:mod:`shardpoint.adapters.registry`) holds them most specific
first, with ``TreeAdapter`` last as the fallback; a new framework joins with
:func:`register_adapter` and no change anywhere else. What else a framework
needs is an ability with a default on :class:`Adapter` (``context_facts``,
``implied_rules``, ``is_stepped``...), so nothing outside the adapters names
a framework.

Example (``CounterAdapter`` as in :class:`Adapter`'s example)::

    import shardpoint as sp
    from shardpoint.adapters import register_adapter

    register_adapter(CounterAdapter, before="module")
    sp.save("ckpt", {"counter": Counter()})
"""

from __future__ import annotations

from .base import Adapter, AdapterContext, ContextFacts, LoadPart, LoadTarget, ParamShard, ParamView, Replicas, SavePart, SaveTensor
from .context import StateFacts, build_context, gather_facts, implied_rules, may_imply_rules, resolve_replicas
from .deepspeed.moe import deepspeed_expert_rules
from .module import unwrap_module
from .registry import adapter_for, default_adapters, register_adapter, registered_adapters, unregister_adapter
from .whole import WholeEntry

__all__ = [
    "Adapter",
    "AdapterContext",
    "ContextFacts",
    "ParamShard",
    "LoadPart",
    "LoadTarget",
    "SavePart",
    "SaveTensor",
    "ParamView",
    "Replicas",
    "build_context",
    "gather_facts",
    "StateFacts",
    "implied_rules",
    "may_imply_rules",
    "resolve_replicas",
    "register_adapter",
    "unregister_adapter",
    "registered_adapters",
    "default_adapters",
    "adapter_for",
    "unwrap_module",
    "WholeEntry",
    "deepspeed_expert_rules",
]
