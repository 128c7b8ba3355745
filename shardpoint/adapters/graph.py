"""A module tree walked without building names: the adapters' checks run it at every save.

``nn.Module.modules()`` goes through ``named_modules``, which builds every
submodule's dotted name; the checks that only ask which modules there are
(an FSDP1 unit anywhere, a Megatron layer, the reuse fingerprint) walk the
children directly, in the same order.
"""

from __future__ import annotations

from torch import nn

__all__ = ["submodules"]


def submodules(m: nn.Module) -> list[nn.Module]:
    """``m`` and every module under it, each once, in the order of ``m.modules()``.

    Example::

        submodules(nn.Sequential(nn.Linear(2, 2)))  # [Sequential(...), Linear(...)]
    """
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [m]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        children = [c for c in x._modules.values() if c is not None]
        children.reverse()
        stack.extend(children)
    return out
