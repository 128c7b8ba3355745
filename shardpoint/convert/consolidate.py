"""A self-contained copy of a checkpoint: what an incremental checkpoint references, copied in.

An incremental checkpoint (``sp.save(..., base=prev)``) reads some chunks
from the data files of older checkpoints. :func:`consolidate` copies the
checkpoint to ``out`` together with every data file it references, so the
copy loads with nothing else present (for export, archiving or moving it
out of its run). The chunks and their checksums are not changed: the copy's
manifest names the copied data files as references to its own folder
(base ``.``), and :func:`references_outside` of it is empty. The copy is
verified against its checksums unless ``verify=False``.

Example::

    sp.consolidate("run/step_00000900", "archive/step_900")
    assert not references_outside("archive/step_900")
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..engine.references import open_references
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage import Storage, storage_for

__all__ = ["consolidate", "references_outside", "describe_references", "consolidate_arguments"]

_PIECE = 16 << 20


def _copy(src: Storage, name: str, size: int, dst: Storage, to: str) -> None:
    buf = bytearray(min(_PIECE, max(size, 1)))
    with dst.open_writer(to) as w:
        for off in range(0, size, _PIECE):
            n = min(_PIECE, size - off)
            mv = memoryview(buf)[:n]
            src.readinto(name, off, mv)
            w.write(mv)


def references_outside(path: str | Storage) -> dict[str, dict[str, int]]:
    """What a checkpoint references outside its folder: ``{base location: {data file: bytes}}``.

    Empty for a self-contained checkpoint. Example::

        references_outside("run/step_00000300")  # {'../step_00000100': {'data/ab-r00000.bin': 1048576}}
    """
    from ..loading.transaction import manifest_bytes

    st = storage_for(path)
    m = Manifest.from_json(manifest_bytes(st), st.url)
    out: dict[str, dict[str, int]] = {}
    for ref in m.refs:
        if ref.base != ".":
            out.setdefault(ref.base, {})[ref.data] = ref.size
    return out


def consolidate(path: str | Storage, out: str | Storage, *, verify: bool = True) -> Manifest:
    """Copy the checkpoint at ``path`` to ``out`` with every data file it references; return the copy's manifest.

    ``out`` must not hold a checkpoint yet. A base that is gone raises
    :class:`~shardpoint.errors.MissingBaseError` before anything is written;
    the manifest is written last, so a failed copy is never a checkpoint.

    Example::

        sp.consolidate("run/step_00000900", "archive/step_900")
    """
    from ..loading.transaction import manifest_bytes
    from .verify import verify_checkpoint

    src = storage_for(path)
    dst = storage_for(out)
    m = Manifest.from_json(manifest_bytes(src), src.url)
    routed = open_references(src, m, src.url)  # every base present, before anything is written
    if dst.exists(MANIFEST_NAME):
        raise CheckpointError(f"{dst.url} already holds a checkpoint; consolidate into a new folder")
    for name, size in m.files.items():
        _copy(src, name, size, dst, name)
    files = dict(m.files)
    refs = []
    for ref in m.refs:
        if ref.data not in files:
            _copy(routed, ref.name, ref.size, dst, ref.data)
            files[ref.data] = ref.size
        refs.append(dataclasses.replace(ref, base="."))
    copy = dataclasses.replace(m, files=files, refs=tuple(refs))
    dst.put_atomic(MANIFEST_NAME, copy.to_json())
    if verify:
        _, problems = verify_checkpoint(dst, quiet=True)
        if problems:
            raise CorruptCheckpointError(f"{dst.url}: the consolidated copy fails verification: {problems[0]}")
    return copy


def describe_references(m: Manifest) -> list[dict[str, Any]]:
    """The rows ``shardpoint inspect`` prints for a manifest's references outside its folder.

    Example::

        describe_references(sp.read_manifest("run/step_00000300", chunks=False))
    """
    rows: dict[str, dict[str, Any]] = {}
    for ref in m.refs:
        if ref.base == ".":
            continue
        row = rows.setdefault(ref.base, {"base": ref.base, "files": set(), "bytes": 0})
        if ref.data not in row["files"]:
            row["files"].add(ref.data)
            row["bytes"] += ref.size
    return [{"base": r["base"], "files": len(r["files"]), "bytes": r["bytes"]} for r in rows.values()]


def consolidate_arguments(parser: Any) -> None:
    """The arguments of ``shardpoint consolidate PATH OUT``, and the function it runs.

    Example::

        consolidate_arguments(sub.add_parser("consolidate"))
    """
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--no-verify", action="store_true", help="skip checking the copy's checksums")
    parser.add_argument("--quiet", "-q", action="store_true")
    parser.set_defaults(fn=_run)


def _run(args: Any) -> int:
    m = consolidate(args.path, args.out, verify=not args.no_verify)
    if not args.quiet:
        print(f"wrote a self-contained copy to {args.out} ({len(m.files)} files)", file=sys.stderr)
    return 0
