"""Incremental saves: chunks whose bytes equal the base checkpoint's are referenced, not written.

``sp.save(path, state, base=prev)`` runs the ordinary save with one step
added before the write: each rank takes the chunks it would write
(:attr:`~shardpoint.planning.save_plan.SavePlan.mine`) and, for each, looks
for the chunk at the same place in ``prev``: the same tensor name, dtype
and global shape, the same box and flat range, the same byte count and
``prev`` saved with the same checksum block size. It hashes its bytes
(xxh3_64 per block, what the writer computes anyway) and compares them with
``prev``'s recorded checksums. Every block equal: the chunk is referenced
(its record names ``prev``'s data file, or the file ``prev`` itself
referenced: references are flat). Otherwise, or with nothing at the same
place (a resharded layout, another block size): it is written in full.

Each rank reads ``prev``'s manifest and the index files its own chunks need
(:class:`~shardpoint.engine.indexes.IndexReader`): no collective is added.
A background save (``AsyncSaver.save(..., base=prev)``) applies the same
rules on its writer, to the staged copy (:mod:`shardpoint.saving.staged_base`);
its base may be a :class:`ChosenBase`, resolved only then.

Why checksums and no byte comparison: a 64-bit hash per 4 MiB block gives
an accidental false match a chance of 2**-64 per block, the same odds every
load already accepts to detect damage, and comparing bytes would read the
whole base at every save. xxh3 is not a cryptographic hash, so a state made
on purpose to collide is out of scope (whoever controls the state controls
what is saved anyway).

Example::

    base = open_base("ckpt/step_100", storage_for("ckpt/step_200"), "ckpt/step_200")
    write, reused = split_reused(base, plan.mine, rank=0, block=DEFAULT_BLOCK_SIZE)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..engine.commit import write_index
from ..engine.indexes import IndexReader, wanted_box
from ..engine.io import tensor_bytes
from ..errors import BaseLocationError, CheckpointError, CheckpointNotFoundError
from ..format.datafile import block_checksums
from ..format.manifest import MANIFEST_NAME, ChunkMeta, Manifest
from ..format.strict import Limits
from ..format.refs import RefFiles, check_base, join_base, ref_index_name
from ..items import SaveTensor, dtype_name
from ..storage import Storage, storage_for
from ..storage.locations import relative_location

__all__ = ["BaseCheckpoint", "Reused", "ChosenBase", "open_base", "candidate_chunk", "reused_chunk", "split_reused",
           "write_references", "reference_base", "resolve_base"]


@dataclass(frozen=True)
class BaseCheckpoint:
    """The committed checkpoint a save references: its storage, manifest, and location from the new one.

    ``to_base`` is the base's location relative to the checkpoint being
    saved (``../step_100``). Build it with :func:`open_base`.

    Example::

        base = open_base("ckpt/step_100", storage_for("ckpt/step_200"), "ckpt/step_200")
        base.to_base   # '../step_100'
    """

    storage: Storage
    manifest: Manifest
    to_base: str
    reader: IndexReader


@dataclass(frozen=True)
class Reused:
    """One chunk a save references: its tensor, its record (naming the data file as the new checkpoint does), and where that file lies.

    Example::

        Reused("model.w", chunk, "../step_100", "data/ab12-r00000.bin", 4096)
    """

    fqn: str
    chunk: ChunkMeta
    base: str
    data: str
    size: int


@dataclass(frozen=True)
class ChosenBase:
    """A base chosen by the save itself, when it opens it: ``choose()`` gives a committed checkpoint or ``None``.

    ``choose`` returns what ``base=`` takes (a path, URL or storage), or
    ``None`` for a save written in full. A background save calls it on its
    writer, after claiming its path: :class:`~shardpoint.CheckpointManager`
    (``incremental=True``) gives one that picks the newest committed step
    and protects it from retention until the save ends.

    Example::

        sp.save("ckpt/step_300", state, base=ChosenBase(lambda: "ckpt/step_200"))
    """

    choose: Callable[[], Any]


def resolve_base(base: Any) -> Any:
    """The checkpoint ``base=`` names now: a :class:`ChosenBase`'s choice, else ``base`` itself.

    Example::

        resolve_base(ChosenBase(lambda: None))   # None: nothing to reference
    """
    return base.choose() if isinstance(base, ChosenBase) else base


def open_base(base: Any, storage: Storage, where: str) -> BaseCheckpoint:
    """Open ``base`` (a path, URL or storage holding a committed checkpoint) for a save to ``storage``.

    Raises :class:`~shardpoint.errors.BaseLocationError` when ``base`` does
    not lie beside the new checkpoint on the same storage (a reference is a
    relative location, resolved from the new checkpoint's storage when it
    loads), or is the new checkpoint itself. On a
    :class:`~shardpoint.storage.tiers.TieredStorage` both must be children
    of tiers with the same roots: references then resolve in every tier.

    Example::

        base = open_base("ckpt/step_100", storage_for("ckpt/step_200"), "ckpt/step_200")
    """
    prev = storage_for(base)
    try:
        manifest = Manifest.from_json(prev.get_limited(MANIFEST_NAME, Limits.from_env().manifest_bytes), prev.url)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{where}: base={prev.url} holds no committed checkpoint; give a committed one, or save without base="
        ) from None
    rel = relative_location(storage, prev)
    why = _unreferenceable(storage, prev, rel)
    if why:
        raise BaseLocationError(f"{where}: base={prev.url} cannot be referenced from here: {why}")
    return BaseCheckpoint(prev, manifest, rel, IndexReader(prev, manifest, prev.url))


def _unreferenceable(storage: Storage, prev: Storage, rel: str | None) -> str:
    """Why ``prev`` cannot be named as ``rel`` from ``storage`` (with the fix), or ``""``."""
    for st in (storage, prev):
        if st.place() is None:
            return (f"{type(st).__name__} ({st.url}) cannot name another location of its tree; save without base=, "
                    "or use a storage that can (local, memory, S3, fsspec, tiered)")
    if storage.tiered != prev.tiered:
        return ("references resolve in every tier of one TieredStorage, and only one of the two is tiered; "
                "give base= as a child of the same TieredStorage as the new checkpoint (run.child('step_100') "
                "for run.child('step_200'))")
    if rel is None:
        tiers = " under tiers with other roots" if storage.tiered else ""
        return (f"it lies on another storage{tiers} (another filesystem, bucket or MemoryStorage instance), and an "
                "incremental save references a committed checkpoint beside it on the same storage (e.g. ckpt/step_100 "
                "for ckpt/step_200); save without base= or choose a base in the same run folder")
    if rel == ".":  # the path itself: its cleanup would remove the base's data
        return "it is the path being saved; give an earlier checkpoint beside it as base="
    try:
        check_base(rel)
    except CheckpointError:
        return (f"it lies inside the new checkpoint's folder ({rel}); an incremental save references a committed "
                "checkpoint beside it on the same storage (e.g. ckpt/step_100 for ckpt/step_200)")
    return ""


def candidate_chunk(base: BaseCheckpoint, item: SaveTensor, block: int) -> ChunkMeta | None:
    """The chunk of ``base`` at the same place as ``item``, or ``None``.

    Example::

        candidate_chunk(base, item, 1 << 22)  # a ChunkMeta of the base, or None
    """
    m = base.manifest
    meta = m.tensors.get(item.fqn)
    if m.block_size != block or meta is None or meta.dtype != dtype_name(item.data.dtype):
        return None
    if tuple(meta.shape) != tuple(item.shape):
        return None
    chunks = meta.chunks if meta.chunks is not None else base.reader.chunks(item.fqn, [wanted_box(item.box, item.flat)])
    for c in chunks:
        if c.box == item.box and c.flat == item.flat and c.nbytes == item.nbytes:
            return c
    return None


def reused_chunk(base: BaseCheckpoint, fqn: str, c: ChunkMeta, rank: int) -> Reused:
    """``c`` (a chunk of the base) as the new checkpoint references it: at the checkpoint that holds its bytes.

    Example::

        reused_chunk(base, "model.w", chunk, rank=0).base   # '../step_100'
    """
    m = base.manifest
    held = next((r for r in m.refs if r.name == c.file), None)
    if held is None:
        where, data, size = base.to_base, c.file, m.files[c.file]
    else:  # the base references it in turn: point at the holder itself
        where, data, size = join_base(base.to_base, held.base), held.data, held.size
    rec = ChunkMeta(c.box, f"{where}/{data}", c.offset, c.nbytes, c.checksums, c.flat, rank)
    return Reused(fqn, rec, where, data, size)


def split_reused(base: BaseCheckpoint, items: Sequence[SaveTensor], rank: int, block: int) -> tuple[list[SaveTensor], list[Reused]]:
    """``items`` split into those to write and the chunks referenced from ``base`` (equal bytes at the same place).

    Example::

        write, reused = split_reused(base, plan.mine, rank=0, block=1 << 22)
    """
    write: list[SaveTensor] = []
    reused: list[Reused] = []
    for it in items:
        c = candidate_chunk(base, it, block)
        if c is not None and tuple(block_checksums(tensor_bytes(it.data), block)) == tuple(c.checksums):
            reused.append(reused_chunk(base, it.fqn, c, rank))
        else:
            write.append(it)
    return write, reused


def write_references(
    storage: Storage, save_id: str, rank: int, reused: Sequence[Reused], dtypes: Mapping[str, str]
) -> tuple[tuple[RefFiles, ...], dict[str, int]]:
    """Write one index file per referenced data file; return their manifest entries and ``{index: size}``.

    Example::

        refs, files = write_references(storage, save_id, 0, reused, {"model.w": "float32"})
    """
    by_file: dict[str, list[Reused]] = {}
    for r in reused:
        by_file.setdefault(r.chunk.file, []).append(r)
    refs, files = [], {}
    for k, (name, group) in enumerate(sorted(by_file.items())):
        index = ref_index_name(save_id, rank, k)
        first = group[0]
        entry, size = write_index(storage, name, [(r.fqn, r.chunk) for r in group], dtypes, index=index)
        refs.append(RefFiles(rank, first.base, first.data, first.size, index, entry.digest))
        files[index] = size
    return tuple(refs), files


def reference_base(tx: Any, mine: Sequence[SaveTensor]) -> list[SaveTensor]:
    """A save transaction's write step for ``base=``: reference what equals the base, return what to write.

    The references' index files are written now and kept on ``tx.refs``
    for the rank's summary.

    Example::

        mine = reference_base(tx, tx.plan.mine)
    """
    prev = resolve_base(tx.options.base)
    if prev is None:
        return list(mine)
    base = open_base(prev, tx.storage, tx.where)
    write, reused = split_reused(base, mine, tx.comm.rank, tx.options.block_size)
    if reused:
        dtypes = {it.fqn: dtype_name(it.data.dtype) for it in mine}
        tx.refs = write_references(tx.storage, tx.save_id, tx.comm.rank, reused, dtypes)
        tx.result.bytes_referenced = sum(r.chunk.nbytes for r in reused)
    return write
