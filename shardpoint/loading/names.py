"""Which names a load touches: ``keys=`` selection, the checkpoint's entries, typo suggestions."""

from __future__ import annotations

import difflib
import fnmatch
import logging
from typing import Iterable

from ..errors import KeyMismatchError
from ..format.manifest import Manifest

__all__ = ["entry_selected", "name_selected", "entry_keys", "close_names", "suggestions", "check_patterns"]

log = logging.getLogger("shardpoint")


def entry_selected(key: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select anything under the top-level entry ``key``."""
    return any(fnmatch.fnmatchcase(key, p) or p.startswith(key + ".") or fnmatch.fnmatchcase(key + ".x", p) for p in patterns)


def name_selected(name: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select the tensor or entry ``name``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def entry_keys(manifest: Manifest) -> list[str]:
    """Every top-level key of the checkpoint: entries with values, and the tops of tensor names."""
    keys = dict.fromkeys(manifest.values)
    keys.update(dict.fromkeys(f.split(".", 1)[0] for f in manifest.tensors))
    return list(keys)

def close_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The names of ``candidates`` closest to ``name`` (a typo's likely fix), best first.

    Example::

        close_names("model.layr.0.w", ["model.layer.0.w", "model.head.w"])  # ['model.layer.0.w']
    """
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.6)


def suggestions(names: Iterable[str], candidates: Iterable[str], limit: int = 5) -> str:
    """``"; did you mean 'a.b' for 'a.c'?"`` for the first ``limit`` of ``names`` with a close candidate, else ``""``.

    Example::

        suggestions(["model.wieght"], ["model.weight"])  # "; did you mean 'model.weight' for 'model.wieght'?"
    """
    pool = list(candidates)
    hints = []
    for name in list(names)[:limit]:
        close = close_names(name, pool, 1)
        if close:
            hints.append(f"{close[0]!r} for {name!r}")
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def check_patterns(where: str, patterns: list[str], manifest: Manifest, strict: bool) -> None:
    """Raise (``strict``) or log for ``keys=`` patterns that select nothing in the checkpoint (typos, most likely).

    The message suggests the closest names and name prefixes (``model.layers.*``).

    Example::

        check_patterns("ckpt", ["model.layrs.*"], manifest, strict=True)  # KeyMismatchError
    """
    names = list(manifest.tensors) + list(manifest.values)
    bad = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) or n.startswith(p + ".") for n in names)]
    if not bad:
        return
    prefixes = {".".join(n.split(".")[:i]) + ".*" for n in names for i in range(1, n.count(".") + 1)}
    msg = f"{where}: keys= pattern(s) {bad} select nothing in the checkpoint{suggestions(bad, names + sorted(prefixes))}"
    if strict:
        raise KeyMismatchError(msg + " (pass strict=False to load what the other patterns select)", bad, [])
    log.warning("%s", msg)
