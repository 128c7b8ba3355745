"""``torch.save`` files, both ways.

:func:`export_torch` writes a plain state dict of full tensors,
``{name: tensor}``, that ``torch.load(..., weights_only=True)`` reads and
``model.load_state_dict`` accepts. ``torch.save`` needs every tensor at once,
so the file is written in two passes: first the pickle and the zip records
with no tensor bytes (``torch.serialization.skip_data`` over fake tensors),
then each tensor is read from the checkpoint and copied into the file through
a shared memory map. Tensor data never piles up in anonymous memory.

:func:`import_torch` reads a ``torch.save`` file. Loading one unpickles it,
and unpickling runs whatever code the file's author chose: it needs
``allow_pickle=True`` (``--allow-pickle``), and then uses
``torch.load(weights_only=False)``, memory-mapped where the file allows.

Example::

    export_torch("ckpt/step_100", "model.pt")                     # {"layers.0.w": ...}
    import_torch("model.pt", "ckpt/from_pt", allow_pickle=True)   # loads into {"model": model}
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import Counter
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import ConversionError
from ..format.datafile import DEFAULT_BLOCK_SIZE
from ..items import torch_dtype
from .common import CheckpointReader, CheckpointWriter, encodable, encode_entries, path_name, walk
from .options import NameMap, cast, parse_rename, pickle_allowed, prepare_output_dir, progress, top_key
from .hf import ImportResult

__all__ = ["export_torch", "import_torch", "TORCH_TRUST_HELP"]

TORCH_TRUST_HELP = (
    "a torch.save file is a Python pickle, and unpickling runs whatever code the file's author "
    "put there. Import only files you trust, and say so with --allow-pickle (allow_pickle=True)."
)


def export_torch(
    path: str,
    out: str,
    *,
    prefix: str = "model.",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    force: bool = False,
    quiet: bool = True,
    verify: bool = True,
) -> ImportResult:
    """Write the tensors of ``path`` under ``prefix`` as one ``torch.save`` state dict ``out``.

    Names lose ``prefix`` and go through ``rename`` (``REGEX=REPLACEMENT``);
    ``keys`` are globs over checkpoint names; ``dtype`` casts floating-point
    tensors. With ``prefix=""`` every tensor is written under its full name.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    reader = CheckpointReader(path, verify=verify)
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    plan: list[tuple[str, str, torch.dtype, tuple]] = []
    seen: dict[str, str] = {}
    for fqn in reader.names():
        name = names.export_name(fqn)
        if name is None:
            continue
        if name in seen:
            raise ConversionError(f"{reader.where}: tensors {seen[name]!r} and {fqn!r} both map to {name!r}")
        seen[name] = fqn
        meta = reader.meta(fqn)
        dt = torch_dtype(meta.dtype)
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        plan.append((fqn, name, dt, tuple(meta.shape)))
    if not plan:
        raise ConversionError(f"{reader.where}: no tensor matches prefix {prefix!r}; try --prefix ''")
    if os.path.exists(out) and not force:
        raise ConversionError(f"{out} exists; pass --force to replace it")
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    try:
        with FakeTensorMode():
            fakes = {name: torch.empty(shape, dtype=dt) for _, name, dt, shape in plan}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fakes, tmp)
        del fakes
        result = ImportResult(out)
        total = sum(torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for _, _, dt, s in plan)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(tmp, mmap=True, weights_only=True)
        with progress(total, "export torch", quiet) as bar:
            for fqn, name, dt, _ in plan:
                t = cast(reader.read(fqn), dt)
                mapped[name].copy_(t)
                n = t.numel() * t.element_size()
                result.bytes += n
                bar.update(n)
                del t
        del mapped
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a failed export leaves no partial file behind
        raise
    os.replace(tmp, out)
    result.tensors = len(plan)
    return result


def _load(src: str) -> Any:
    try:
        return torch.load(src, map_location="cpu", mmap=True, weights_only=False)
    except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
        return torch.load(src, map_location="cpu", weights_only=False)


def import_torch(
    src: str,
    path: str,
    *,
    allow_pickle: bool = False,
    trust_pickle: bool | None = None,
    prefix: str = "model.",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
    quiet: bool = True,
) -> ImportResult:
    """Write the tensors (and storable plain values) of the ``torch.save`` file ``src`` as a checkpoint.

    Refuses unless ``allow_pickle`` (``trust_pickle`` is its deprecated old name) (see :data:`TORCH_TRUST_HELP`). The loaded
    object goes under the state key of ``prefix`` (``"model."`` puts a state
    dict where ``sp.load(path, {"model": model})`` finds it); with
    ``prefix=""`` the object must be a dict whose keys become the state keys
    (``{"model": ..., "optimizer": ..., "step": 3}``). A pickled
    ``nn.Module`` contributes its ``state_dict()``. ``rename`` and ``keys``
    act on the dotted leaf names; with them, every entry is stored flat.
    Values the manifest cannot store without pickle are skipped and listed.
    """
    pickle_allowed(allow_pickle, trust_pickle, src, TORCH_TRUST_HELP)
    if not os.path.isfile(src):
        raise ConversionError(f"{src}: no such file")
    top = top_key(prefix)
    obj = _load(src)
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if not top and not isinstance(obj, dict):
        raise ConversionError(f"{src} holds a {type(obj).__name__}, not a dict; pass --prefix model. (or another key)")
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    result = ImportResult(path)
    leaves, tensors = _leaves(src, obj, top, names, bool(rename), result)
    counts = Counter(n for n, _ in tensors)
    dup = {n for n, c in counts.items() if c > 1}
    if dup:
        raise ConversionError(f"{src}: several tensors map to {sorted(dup)[:5]}")
    if "://" not in path:
        prepare_output_dir(path, force)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    written: set[str] = set()
    with CheckpointWriter(path, block_size=block_size, layout={"source": "torch"}) as w, progress(total, "import torch", quiet) as bar:
        for name, t in tensors:
            t = cast(t, dtype)
            w.add(name, t)
            written.add(name)
            n = t.numel() * t.element_size()
            result.bytes += n
            bar.update(n)
        for key, doc in encode_entries(leaves, written, src).items():
            w.set_value(key, doc, kind="values")
        w.commit()
    result.tensors = len(written)
    return result


def _leaves(src: str, obj: Any, top: str, names: NameMap, flat: bool, result: ImportResult) -> tuple[list, list]:
    """The document leaves to store (tensors as ``meta`` stand-ins) and the tensors by stored name.

    Leaves the manifest cannot store without pickle are listed as skipped in ``result``.
    """
    leaves: list[tuple[tuple, Any]] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    for p, leaf in walk(obj):
        raw = path_name(p)
        final = names.import_name(raw)
        if final is None:
            result.skipped.append(raw)
            continue
        if flat:
            first, _, rest = final.partition(".")
            newp = (("d", first), ("d", rest)) if rest else (("d", first),)
        else:
            newp = ((("d", top),) if top else ()) + p
        if not newp:  # a bare tensor or value with no prefix
            raise ConversionError(f"{src} holds a bare {type(leaf).__name__}; pass --prefix")
        if isinstance(leaf, torch.Tensor):
            tensors.append((path_name(newp), leaf))
            leaves.append((newp, torch.empty(0, device="meta")))
        elif encodable(leaf):
            leaves.append((newp, leaf))
        else:
            result.skipped.append(f"{raw} ({type(leaf).__qualname__})")
    return leaves, tensors
