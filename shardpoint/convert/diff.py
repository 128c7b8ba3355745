"""Compare two checkpoints tensor by tensor ("did my resume really load?").

Tensors are compared in blocks of dim-0 rows, so two large checkpoints are
compared in bounded memory, and whatever their shardings: names are logical
tensor names, so a checkpoint saved under FSDP2 on 8 ranks compares with one
saved by a single process. Non-tensor values (step counters, optimizer
hyper-parameters) are compared as stored.

A tensor differs when some element has ``|a - b| > atol + rtol * |b|`` (the
rule of ``torch.allclose``; NaNs in the same places are equal), or when its
dtype or shape differs (with different dtypes the values are still compared,
in the promoted dtype, and reported). The defaults, ``atol = rtol = 0``, ask for equality.

Example::

    d = diff("ckpt/step_100", "resumed/step_100", atol=1e-6)
    if not d.same: print(d.changed)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .common import CheckpointReader
from .options import progress

__all__ = ["diff", "DiffResult", "TensorDiff"]


@dataclass
class TensorDiff:
    """How one tensor differs: counts and the largest absolute and relative differences."""

    name: str
    dtype: str
    shape: list[int]
    max_abs: float = 0.0
    max_rel: float = 0.0
    n_diff: int = 0
    numel: int = 0
    reason: str = "values"  # "values", "dtype" or "shape"


@dataclass
class DiffResult:
    """The outcome of :func:`diff`. ``same`` is true when nothing differs beyond the tolerances."""

    a: str
    b: str
    atol: float
    rtol: float
    compared: int = 0
    changed: list[TensorDiff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    values_changed: list[str] = field(default_factory=list)
    values_only_a: list[str] = field(default_factory=list)
    values_only_b: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.changed or self.only_a or self.only_b or self.values_changed or self.values_only_a or self.values_only_b)

    def to_json(self) -> dict:
        d = asdict(self)
        d["same"] = self.same
        return d


def _compare(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, int]:
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        if a.dtype == torch.bool:
            a, b = a.to(torch.int8), b.to(torch.int8)
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        delta = (a64 - b64).abs()
        exact = a != b
        bad = exact & (delta > atol + rtol * b64.abs()) if (atol or rtol) else exact
        nan_same = None
    else:
        if a.is_complex():
            a64, b64 = a.to(torch.complex128), b.to(torch.complex128)
        else:
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
        nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
        nan_same = nan_a & nan_b
        delta = (a64 - b64).abs()
        delta = torch.where(nan_same, torch.zeros_like(delta), delta)
        delta = torch.where(nan_a ^ nan_b, torch.full_like(delta, math.inf), delta)
        both_inf = torch.isinf(a64) & torch.isinf(b64) & (a64 == b64)
        delta = torch.where(both_inf, torch.zeros_like(delta), delta)
        bad = delta > atol + rtol * b64.abs()
    if delta.numel() == 0:
        return 0.0, 0.0, 0
    max_abs = float(delta.max())
    denom = b64.abs()
    rel = torch.where(denom > 0, delta / denom.clamp_min(1e-300), torch.where(delta > 0, math.inf, 0.0))
    return max_abs, float(rel.max()), int(bad.sum())


def _is_ref(doc) -> bool:
    return isinstance(doc, dict) and doc.get("__sp__") == "tensor"


def _strip(doc):
    if isinstance(doc, dict) and "__sp__" not in doc:
        return {k: _strip(v) for k, v in doc.items() if not _is_ref(v)}
    if isinstance(doc, list):
        return [None if _is_ref(v) else _strip(v) for v in doc]
    return doc


def _plain(doc) -> str:
    """A value document without its tensor references (tensors are compared by name)."""
    return json.dumps(_strip(doc), sort_keys=True)


def diff(
    a: str,
    b: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys: Sequence[str] = (),
    values: bool = True,
    block_bytes: int = 64 << 20,
    quiet: bool = True,
    verify: bool = True,
) -> DiffResult:
    """Compare checkpoints ``a`` and ``b``; ``keys`` (globs) restricts the tensors compared."""
    ra, rb = CheckpointReader(a, verify=verify), CheckpointReader(b, verify=verify)
    na, nb = set(ra.names(keys)), set(rb.names(keys))
    res = DiffResult(ra.where, rb.where, atol, rtol)
    res.only_a = sorted(na - nb)
    res.only_b = sorted(nb - na)
    both = sorted(na & nb)
    total = sum(ra.meta(n).nbytes for n in both)
    with progress(total, "diff", quiet) as bar:
        for name in both:
            ma, mb = ra.meta(name), rb.meta(name)
            res.compared += 1
            if tuple(ma.shape) != tuple(mb.shape):
                res.changed.append(TensorDiff(name, ma.dtype, list(ma.shape), math.inf, math.inf, ma.numel, ma.numel, f"shape {list(ma.shape)} vs {list(mb.shape)}"))
                continue
            # A dtype change always counts as a difference; the values are still compared.
            same_dtype = ma.dtype == mb.dtype
            td = TensorDiff(name, ma.dtype if same_dtype else f"{ma.dtype} vs {mb.dtype}", list(ma.shape),
                            numel=ma.numel, reason="values" if same_dtype else "dtype")
            for box, pa in ra.row_blocks(name, block_bytes):
                pb = rb.read(name, box)
                if not same_dtype:
                    common = torch.promote_types(pa.dtype, pb.dtype)
                    pa, pb = pa.to(common), pb.to(common)
                mx, rel, nd = _compare(pa, pb, atol, rtol)
                td.max_abs, td.max_rel, td.n_diff = max(td.max_abs, mx), max(td.max_rel, rel), td.n_diff + nd
                bar.update(pa.numel() * pa.element_size())
            if td.n_diff or not same_dtype:
                res.changed.append(td)
    if values and not keys:
        va, vb = ra.manifest.values, rb.manifest.values
        res.values_only_a = sorted(set(va) - set(vb))
        res.values_only_b = sorted(set(vb) - set(va))
        res.values_changed = sorted(k for k in set(va) & set(vb) if _plain(va[k]) != _plain(vb[k]))
    return res
