"""What the converters' options mean: dtypes, sizes, rename rules, name maps, output folders.

Every converter (and the ``shardpoint convert`` command) reads its arguments
through these, so ``--dtype bf16``, ``--shard-size 5GB`` and ``--rename``
mean the same everywhere. Errors are
:class:`~shardpoint.errors.ConversionError` naming the bad argument.

Example::

    parse_size("5GB")                       # 5_000_000_000
    NameMap("model.").export_name("model.w")  # "w"
"""

from __future__ import annotations

import fnmatch
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..errors import ConversionError
from ..runtime.extras import require

__all__ = [
    "NameMap",
    "parse_dtype",
    "parse_size",
    "parse_rename",
    "progress",
    "prepare_output_dir",
    "cast",
    "top_key",
    "pickle_allowed",
]


_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(text: str | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16``; ``None``/``"keep"`` -> ``None`` (keep each tensor's dtype)."""
    if text is None or text in ("", "keep", "auto"):
        return None
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise ConversionError(f"unknown dtype {text!r}; choose from {', '.join(sorted(_DTYPES))} or keep") from None


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """A byte count: ``"5GB"`` (10**9 units, as Hugging Face uses), ``"5GiB"`` (2**30), ``"1048576"``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConversionError(f"cannot read size {text!r}; write e.g. 5GB, 500MB, 2GiB or a byte count")
    num, unit = float(m.group(1)), m.group(2).upper()
    unit = unit.removesuffix("B") if unit not in ("", "B") else ""
    if unit.endswith("I"):
        scale = 1 << (10 * "KMGT".index(unit[0]) + 10)
    elif unit:
        scale = 10 ** (3 * "KMGT".index(unit[0]) + 3)
    else:
        scale = 1
    size = int(num * scale)
    if size <= 0:
        raise ConversionError(f"size must be positive, got {text!r}")
    return size


def parse_rename(rules: Iterable[str] | None) -> list[tuple[re.Pattern, str]]:
    """``["^transformer\\.=model.", "\\.attn\\.=.self_attn."]`` -> compiled ``(pattern, replacement)`` pairs.

    Each rule is ``REGEX=REPLACEMENT`` (split at the last ``=``), applied with
    :func:`re.sub` in the order given.
    """
    out = []
    for r in rules or ():
        if "=" not in r:
            raise ConversionError(f"rename rule {r!r} must look like REGEX=REPLACEMENT")
        pat, rep = r.rsplit("=", 1)
        try:
            out.append((re.compile(pat), rep))
        except re.error as e:
            raise ConversionError(f"rename rule {r!r}: bad regular expression: {e}") from None
    return out


@dataclass
class NameMap:
    """How names move between a shardpoint checkpoint and another format.

    On export, a checkpoint tensor name is kept only if it starts with
    ``prefix``, matches one of ``keys`` (globs over the checkpoint name, all
    if empty) and none of ``exclude``; the prefix is stripped, then the ``rename`` rules apply. On
    import the rename rules apply to the source name first, then ``prefix`` is
    prepended. ``model.`` is the usual prefix: ``sp.save(path, {"model": m})``
    stores ``m``'s parameter ``layers.0.w`` as ``model.layers.0.w``.

    Example::

        NameMap("model.", parse_rename(["^lm_head=output"])).export_name("model.lm_head.weight")
        # -> "output.weight"
    """

    prefix: str = ""
    rename: Sequence[tuple[re.Pattern, str]] = ()
    keys: Sequence[str] = ()
    exclude: Sequence[str] = ()

    def _selected(self, name: str) -> bool:
        if self.keys and not any(fnmatch.fnmatchcase(name, k) for k in self.keys):
            return False
        return not any(fnmatch.fnmatchcase(name, k) for k in self.exclude)

    def _renamed(self, name: str) -> str:
        for pat, rep in self.rename:
            name = pat.sub(rep, name)
        return name

    def export_name(self, fqn: str) -> str | None:
        """The other format's name for checkpoint tensor ``fqn``, or ``None`` when it is not exported."""
        if not fqn.startswith(self.prefix) or not self._selected(fqn):
            return None
        return self._renamed(fqn[len(self.prefix):])

    def import_name(self, name: str) -> str | None:
        """The checkpoint name for the other format's tensor ``name``, or ``None`` when it is not imported."""
        if not self._selected(name):
            return None
        return self.prefix + self._renamed(name)


class _NoBar:
    """What ``progress`` returns when quiet: the bar's interface, doing nothing (no tqdm needed)."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(total: float | None, desc: str, quiet: bool, unit: str = "B"):
    """A tqdm bar on stderr (bytes by default); with ``quiet``, a silent stand-in that needs no tqdm."""
    if quiet:
        return _NoBar()
    tqdm = require("tqdm", "cli", "progress bars").tqdm
    return tqdm(total=total, desc=desc, disable=quiet, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000, file=sys.stderr, leave=False)


def prepare_output_dir(path: str, force: bool) -> None:
    """Refuse to write into an existing non-empty folder unless ``force``."""
    import os

    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConversionError(f"{path} exists and is not a folder")
        if os.listdir(path) and not force:
            raise ConversionError(f"{path} exists and is not empty; pass --force to write into it")
    os.makedirs(path, exist_ok=True)


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating-point tensors to ``dtype``; leave integer and bool tensors alone."""
    if dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def top_key(prefix: str) -> str:
    """The state key a name prefix like ``"model."`` stands for (``""`` for no prefix)."""
    if not prefix:
        return ""
    if not prefix.endswith(".") or "." in prefix[:-1] or len(prefix) < 2:
        raise ConversionError(f"an import prefix must be one state key followed by '.', like 'model.'; got {prefix!r}")
    return prefix[:-1]


def pickle_allowed(allow_pickle: bool, trust_pickle: bool | None, src: str, why: str) -> None:
    """Refuse to unpickle ``src`` unless ``allow_pickle``; ``trust_pickle`` is its deprecated old name.

    ``why`` says what in ``src`` is a pickle. Raises
    :class:`~shardpoint.errors.ConversionError` without the opt-in.

    Example::

        pickle_allowed(True, None, "model.pt", TORCH_TRUST_HELP)
    """
    if trust_pickle is not None:
        warnings.warn(
            "trust_pickle= is deprecated; use allow_pickle= (the same meaning, the name sp.save and sp.load use)",
            DeprecationWarning, stacklevel=3,
        )
        allow_pickle = allow_pickle or bool(trust_pickle)
    if not allow_pickle:
        raise ConversionError(f"refusing to import {src} without allow_pickle=True (--allow-pickle): {why}")
