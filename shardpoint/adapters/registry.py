"""The ordered registry of adapters: the first that claims an object handles it.

The order is most specific first. Built in, it is::

    whole       WholeEntryAdapter     entries wrapped in sp.WholeEntry
    deepspeed   DeepSpeedAdapter      DeepSpeed engines and ZeRO optimizers
    optimizer   OptimizerAdapter      torch.optim optimizers
    fsdp1       FSDP1Adapter          modules wrapped in FSDP (version 1)
    megatron    MegatronAdapter       Megatron-Core modules (TP, PP, EP)
    module      ModuleAdapter         any other nn.Module
    stateful    StatefulAdapter       objects with state_dict/load_state_dict
    values      TreeAdapter           everything else (the fallback; always last)

Optimizers and modules are also "stateful" objects, so the framework
adapters come before the generic ``module``, ``stateful`` and ``values``
adapters. A registered adapter goes, by default, just ahead of the generic
ones (after the built-in framework adapters and the adapters registered
before it); ``before=`` places it ahead of any registered adapter. Nothing
goes after the fallback. A save or load reads the registry when it starts,
so the orchestrators never change when a framework joins.
"""

from __future__ import annotations

import threading
from typing import Any

from .base import Adapter
from .deepspeed import DeepSpeedAdapter
from .fsdp1 import FSDP1Adapter
from .megatron import MegatronAdapter
from .module import ModuleAdapter
from .optimizer import OptimizerAdapter
from .tree import StatefulAdapter, TreeAdapter
from .whole import WholeEntryAdapter

__all__ = ["register_adapter", "unregister_adapter", "registered_adapters", "default_adapters", "adapter_for", "FALLBACK", "GENERIC"]

FALLBACK = TreeAdapter.name  # claims everything, so it stays last
GENERIC = ModuleAdapter.name  # where a new adapter goes unless told otherwise

# Process-wide on purpose: an adapter a user registers applies to every save and load in the process.
_lock = threading.Lock()
_order: list[Adapter] = [
    WholeEntryAdapter(), DeepSpeedAdapter(), OptimizerAdapter(), FSDP1Adapter(),
    MegatronAdapter(), ModuleAdapter(), StatefulAdapter(), TreeAdapter(),
]

def _instance(adapter: Adapter | type[Adapter]) -> Adapter:
    obj = adapter() if isinstance(adapter, type) and issubclass(adapter, Adapter) else adapter
    if not isinstance(obj, Adapter):
        raise TypeError(
            f"register_adapter takes a subclass of shardpoint.adapters.Adapter or an instance of one, got {adapter!r}; "
            "derive the adapter from Adapter and implement claims, save and load"
        )
    if not isinstance(obj.name, str) or not obj.name:
        raise ValueError(f"{type(obj).__name__} has no name; set the class attribute name = '<framework>'")
    return obj


def _position(before: str | type[Adapter]) -> int:
    name = before.name if isinstance(before, type) and issubclass(before, Adapter) else before
    for i, a in enumerate(_order):
        if a.name == name:
            return i
    raise ValueError(f"register_adapter(before={before!r}): no adapter of that name is registered; registered: {[a.name for a in _order]}")


def register_adapter(adapter: Any = None, *, before: str | type[Adapter] = GENERIC) -> Any:
    """Add an adapter to the registry, ahead of the adapter named ``before``.

    ``adapter`` is an :class:`Adapter` instance or subclass (a subclass is
    instantiated without arguments). Used without ``adapter`` it is a class
    decorator. ``before`` names a registered adapter (or is its class); by
    default the new adapter goes ahead of the generic ``module``,
    ``stateful`` and ``values`` adapters, so it sees ``nn.Module`` and
    ``state_dict`` objects before they do; pass ``before="optimizer"`` (or
    another framework adapter's name) to come ahead of that one too. Names
    are unique: registering a name twice raises ``ValueError`` (call
    :func:`unregister_adapter` first to replace one). Returns ``adapter``.

    Example::

        @register_adapter
        class CounterAdapter(Adapter):
            name = "counter"
            ...

        register_adapter(MyOptimizerAdapter(), before="optimizer")
    """
    if adapter is None:
        return lambda a: register_adapter(a, before=before)
    obj = _instance(adapter)
    with _lock:
        if any(a.name == obj.name for a in _order):
            raise ValueError(f"an adapter named {obj.name!r} is already registered; call unregister_adapter({obj.name!r}) first to replace it")
        _order.insert(_position(before), obj)
    return adapter


def unregister_adapter(name: str) -> Adapter:
    """Remove the adapter named ``name`` from the registry and return it.

    The fallback (``"values"``) stays: every object must have an adapter.

    Example::

        unregister_adapter("counter")
    """
    if name == FALLBACK:
        raise ValueError(f"the fallback adapter {FALLBACK!r} cannot be removed: every object needs an adapter")
    with _lock:
        i = _position(name)
        return _order.pop(i)


def registered_adapters() -> list[str]:
    """The names of the registered adapters, in the order they are asked.

    Example::

        registered_adapters()  # ['whole', 'deepspeed', 'optimizer', ..., 'values']
    """
    with _lock:
        return [a.name for a in _order]


def default_adapters() -> list[Adapter]:
    """A fresh list of the registered adapters, most specific first.

    Example::

        adapter_for(model, default_adapters()).name  # 'module'
    """
    with _lock:
        return list(_order)


def adapter_for(obj: Any, adapters: list[Adapter]) -> Adapter:
    """The first adapter of ``adapters`` that claims ``obj``.

    Example::

        adapter_for({"lr": 0.1}, default_adapters()).name  # 'values'
    """
    for a in adapters:
        if a.claims(obj):
            return a
    raise AssertionError("the fallback adapter claims everything")  # pragma: no cover
