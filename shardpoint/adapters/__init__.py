"""Adapters: one per framework, tried in order; the first that claims an object handles it.

The order matters: optimizers and modules are also "stateful" objects, so the
specific adapters come before the generic ``StatefulAdapter`` and the
``TreeAdapter`` fallback.
"""

from __future__ import annotations

from typing import Any

from .base import AdapterContext, LoadPart, LoadTarget, ParamView, Replicas, SavePart, SaveTensor
from .context import build_context, resolve_replicas
from .deepspeed import DeepSpeedAdapter
from .fsdp1 import FSDP1Adapter
from .megatron import MegatronAdapter
from .module import ModuleAdapter, unwrap_module
from .optimizer import OptimizerAdapter
from .tree import StatefulAdapter, TreeAdapter
from .whole import WholeEntry, WholeEntryAdapter

__all__ = [
    "AdapterContext",
    "LoadPart",
    "LoadTarget",
    "SavePart",
    "SaveTensor",
    "ParamView",
    "Replicas",
    "build_context",
    "resolve_replicas",
    "default_adapters",
    "adapter_for",
    "unwrap_module",
    "WholeEntry",
]


def default_adapters() -> list:
    """A fresh list of the built-in adapters, most specific first."""
    return [WholeEntryAdapter(), DeepSpeedAdapter(), OptimizerAdapter(), FSDP1Adapter(), MegatronAdapter(), ModuleAdapter(), StatefulAdapter(), TreeAdapter()]


def adapter_for(obj: Any, adapters: list) -> Any:
    for a in adapters:
        if a.claims(obj):
            return a
    raise AssertionError("TreeAdapter claims everything")  # pragma: no cover
