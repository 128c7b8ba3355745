"""Compaction: after retention, a removed step's data file keeps only the chunks that kept steps reference.

In an incremental run a kept step references chunks in the data files of
older steps. When retention removes such an older step, its data files may
hold chunks no kept step uses any more (the adapter of that step, next to
the frozen base that later steps still reference). Compaction *moves* the
referenced chunks so that the run folder holds only what its kept
checkpoints reference:

1. write a new data file in the removed step's folder with only the
   referenced byte ranges (each chunk 64-byte aligned, as every data file;
   the bytes are identical, so every chunk checksum stays valid), and make
   it durable;
2. for each kept step that references the old file: write new reference
   index files (new offsets), then replace its manifest atomically (the
   same :meth:`~shardpoint.format.manifest.Manifest.to_json`, which seals
   the digest, and the storage's ``put_atomic`` that commits a save), then
   remove its old index files;
3. remove the old file.

A crash at any point leaves every kept step loadable: until the last
manifest is switched both files exist, and a manifest names either the old
file and its old index or the new ones. Whatever a crash leaves behind that
no manifest lists (a new data file not yet referenced, an old data or index
file no longer referenced) is removed by a later pass. A file every byte of
which is referenced is kept as it is (nothing is copied).

Switching manifests under a save that reads its base, or a load that reads
a kept step, would pull the old file from under them. So a file is switched
only while this manager saves and restores nothing, and only when no save
started since the pass began (:meth:`~shardpoint.manager.retention.StepsInUse.run_if_quiet`);
otherwise the new file is removed and a later pass tries again.

Example::

    kept = read_kept(run, [5, 6])                       # {step: (bytes, Manifest)}, or None
    moved = compact_run(run, kept, in_use, generation)  # ['step_00000001/data/ab..-r00000.bin']
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..engine.commit import write_index
from ..engine.indexes import IndexReader
from ..errors import CheckpointError
from ..format.blocks import ALIGN
from ..format.folders import STEP_PATTERN
from ..format.manifest import MANIFEST_NAME, ChunkMeta, Manifest
from ..format.refs import RefFiles, ref_index_name
from ..format.strict import Limits
from ..storage import Storage
from .folders import step_folder

__all__ = ["KeptManifests", "FilePlan", "read_kept", "holders", "plan_file", "compact_run"]

log = logging.getLogger("shardpoint")

KeptManifests = Mapping[int, tuple[bytes, Manifest]]
"""The kept steps' manifests as a pass read them: ``{step: (manifest bytes, parsed manifest)}``."""

_PIECE = 16 << 20


def read_kept(storage: Storage, steps: Iterable[int]) -> dict[int, tuple[bytes, Manifest]] | None:
    """The manifests of ``steps`` under the run root ``storage``, read bounded and parsed as untrusted input.

    ``None`` when one cannot be read or parsed: the caller then deletes and
    moves nothing (it cannot know what is referenced).

    Example::

        kept = read_kept(run, [200, 300])
    """
    out: dict[int, tuple[bytes, Manifest]] = {}
    limit = Limits.from_env().manifest_bytes
    for s in steps:
        st = storage.child(step_folder(s))
        try:
            raw = st.get_limited(MANIFEST_NAME, limit)
            out[s] = (raw, Manifest.from_json(raw, st.url))
        except Exception as e:  # noqa: BLE001 - unreadable: nothing is deleted this pass
            log.warning("%s: cannot read the manifest of %s (%s); no data deleted this pass", storage.url, step_folder(s), e)
            return None
    return out


def holders(kept: KeptManifests) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Each data file of a step folder of the run that ``kept`` references: ``{(folder, data): [(step, ref position)]}``.

    Example::

        holders(read_kept(run, [5, 6]))   # {("step_00000001", "data/ab-r00000.bin"): [(5, 0), (6, 0)]}
    """
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for s, (_, m) in sorted(kept.items()):
        for pos, ref in enumerate(m.refs):
            folder = posixpath.normpath(posixpath.join(step_folder(s), ref.base))
            if STEP_PATTERN.match(folder):  # a step folder of this run; references elsewhere are not ours
                out.setdefault((folder, ref.data), []).append((s, pos))
    return out


@dataclass(frozen=True)
class FilePlan:
    """How one data file is compacted: the byte ranges kept, where they go, and the references to rewrite.

    ``pieces`` are ``(old start, old stop, new start)``; ``records`` maps
    each ``(step, ref position)`` to its chunk records (in the old file).

    Example::

        plan = plan_file(run, "step_00000001", "data/ab-r00000.bin", [(5, 0)], kept)
        plan.new_size < plan.size   # True: there was something to drop
    """

    folder: str
    data: str
    size: int
    new_data: str
    new_size: int
    pieces: tuple[tuple[int, int, int], ...]
    records: Mapping[tuple[int, int], tuple[tuple[str, ChunkMeta], ...]]

    def moved(self, offset: int) -> int:
        """The new offset of a chunk that started at ``offset`` in the old file."""
        for a, b, new in self.pieces:
            if a <= offset < b:
                return new + offset - a
        return 0  # an empty chunk outside every piece: any offset in the file reads nothing


def _records(storage: Storage, step: int, m: Manifest, pos: int) -> tuple[tuple[str, ChunkMeta], ...] | None:
    """The chunk records of reference ``pos`` of step ``step``'s manifest ``m``; ``None`` if some row matches no tensor."""
    ref = m.refs[pos]
    st = storage.child(step_folder(step))
    same_rank = [i for i, r in enumerate(m.refs) if r.rank == ref.rank]
    idx = IndexReader(st, m, st.url).indexes(ref.rank)[-len(same_rank):][same_rank.index(pos)]
    out = []
    for fqn, meta in m.tensors.items():
        out.extend((fqn, c) for c in idx.chunks(fqn, meta.shape, meta.itemsize, f"{st.url}: tensor {fqn!r}", meta.dtype))
    return tuple(out) if len(out) == len(idx) else None


def _layout(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """Merged ``[start, stop)`` ranges laid out one after another, each start keeping its place modulo ``ALIGN``."""
    merged: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    pieces, pos = [], 0
    for a, b in merged:
        new = pos + (a - pos) % ALIGN  # the next position congruent to a: aligned chunks stay aligned
        pieces.append((a, b, new))
        pos = new + b - a
    return tuple(pieces), pos


def plan_file(storage: Storage, folder: str, data: str, users: list[tuple[int, int]], kept: KeptManifests) -> FilePlan | None:
    """The compaction of ``folder/data``, or ``None`` when every byte is referenced or it cannot be planned safely.

    ``None`` also when the file is missing or of another size than the
    references say, or an index has rows matching no tensor: the file is
    then left as it is, and a load reports what is wrong with it.

    Example::

        plan = plan_file(run, "step_00000001", "data/ab-r00000.bin", [(5, 0), (6, 0)], kept)
    """
    holder = storage.child(folder)
    try:
        size = holder.size(data)
    except FileNotFoundError:
        return None
    records: dict[tuple[int, int], tuple[tuple[str, ChunkMeta], ...]] = {}
    for step, pos in users:
        m = kept[step][1]
        try:
            rec = _records(storage, step, m, pos) if m.refs[pos].size == size else None
        except CheckpointError as e:  # a damaged index: the file stays whole, a load reports the damage
            log.warning("%s/%s: not compacted: %s", storage.url, folder, e)
            return None
        if rec is None:
            log.warning("%s/%s: not compacted (step %s references it with another size or unknown rows)", storage.url, folder, step)
            return None
        records[(step, pos)] = rec
    pieces, new_size = _layout((c.offset, c.offset + c.nbytes) for rec in records.values() for _, c in rec)
    if new_size >= size:
        return None
    new_data = f"data/{uuid.uuid4().hex[:16]}{data[data.rindex('-r'):]}"
    return FilePlan(folder, data, size, new_data, new_size, pieces, records)


def _write_file(storage: Storage, plan: FilePlan) -> None:
    """Write the compacted file: the kept ranges at their new places, zero bytes between; durable on close."""
    holder = storage.child(plan.folder)
    buf = bytearray(min(_PIECE, max(plan.new_size, 1)))
    pos = 0
    with holder.open_writer(plan.new_data) as w:
        for a, b, new in plan.pieces:
            if new > pos:
                w.write(bytes(new - pos))
            for off in range(a, b, _PIECE):
                mv = memoryview(buf)[: min(_PIECE, b - off)]
                holder.readinto(plan.data, off, mv)
                w.write(mv)
            pos = new + b - a


def _switch_step(storage: Storage, plan: FilePlan, step: int, positions: list[int], kept: KeptManifests,
                 tag: str, hook: Callable[[str, int | None], None]) -> bool:
    """Point step ``step``'s references to the old file at the new one; ``False`` if its manifest changed since the pass read it."""
    raw, m = kept[step]
    st = storage.child(step_folder(step))
    if st.get_limited(MANIFEST_NAME, Limits.from_env().manifest_bytes) != raw:
        log.warning("%s: the manifest changed during retention; %s not compacted", st.url, plan.data)
        return False
    refs, files = list(m.refs), dict(m.files)
    dtypes = {fqn: t.dtype for fqn, t in m.tensors.items()}
    for k, pos in enumerate(positions):
        old = m.refs[pos]
        moved = [(fqn, dataclasses.replace(c, offset=plan.moved(c.offset))) for fqn, c in plan.records[(step, pos)]]
        index = ref_index_name(tag, old.rank, k)
        entry, isize = write_index(st, old.name, moved, dtypes, index=index)
        refs[pos] = RefFiles(old.rank, old.base, plan.new_data, plan.new_size, index, entry.digest)
        files.pop(old.index, None)
        files[index] = isize
    blob = dataclasses.replace(m, refs=tuple(refs), files=files).to_json()
    Manifest.from_json(blob, st.url)  # what a load will parse: never commit a manifest it refuses
    hook("compact", step)
    st.put_atomic(MANIFEST_NAME, blob)
    st.delete_many(sorted({m.refs[p].index for p in positions} - set(files)))
    return True


def _switch(storage: Storage, plan: FilePlan, kept: KeptManifests, hook: Callable[[str, int | None], None]) -> bool:
    """Switch every kept step to the new file, then remove the old one; ``False`` (old file kept) if one could not be."""
    by_step: dict[int, list[int]] = {}
    for step, pos in plan.records:
        by_step.setdefault(step, []).append(pos)
    tag = plan.new_data[len("data/"): plan.new_data.rindex("-r")]
    for step, positions in sorted(by_step.items()):
        if not _switch_step(storage, plan, step, sorted(positions), kept, tag, hook):
            return False
    hook("compact", _step_of(plan.folder))
    storage.child(plan.folder).delete(plan.data)
    return True


def _step_of(folder: str) -> int | None:
    m = STEP_PATTERN.match(folder)
    return int(m.group(1)) if m else None


def _sweep(storage: Storage, kept: KeptManifests) -> None:
    """Remove index files in kept step folders that their manifest no longer lists (left by a crash while switching)."""
    for s, (_, m) in kept.items():
        st = storage.child(step_folder(s))
        stale = [n for n in st.list("data/") if n.endswith(".idx") and n not in m.files]
        if stale:
            fresh = read_kept(storage, [s])  # listed by the manifest committed now? then it stays
            if fresh is None:
                continue
            st.delete_many([n for n in stale if n not in fresh[s][1].files])


def compact_run(
    storage: Storage,
    kept: KeptManifests,
    run_if_quiet: Callable[[Callable[[], bool]], bool | None],
    hook: Callable[[str, int | None], None] = lambda phase, step: None,
) -> list[str]:
    """Compact every data file of a removed step that ``kept`` references in part; return those moved (``folder/data``).

    ``run_if_quiet(fn)`` runs ``fn`` (the switch of the manifests) only
    while no save or restore can see it happen, and answers ``None``
    otherwise (see :meth:`~shardpoint.manager.retention.StepsInUse.run_if_quiet`).
    ``hook("compact", step)`` is called before each durable change (fault injection).

    Example::

        moved = compact_run(run, read_kept(run, [5, 6]), lambda fn: fn())
    """
    kept_folders = {step_folder(s) for s in kept}
    moved = []
    for (folder, data), users in sorted(holders(kept).items()):
        if folder in kept_folders or storage.child(folder).exists(MANIFEST_NAME):
            continue  # a step's own file (its manifest lists it whole)
        plan = plan_file(storage, folder, data, users, kept)
        if plan is None:
            continue
        if run_if_quiet(lambda: True) is None:  # a save or restore began: the switch would be refused, spare the copy
            return moved
        hook("compact", _step_of(folder))
        _write_file(storage, plan)
        hook("compact", _step_of(folder))
        done = run_if_quiet(lambda: _switch(storage, plan, kept, hook))
        if done is None:  # a save or restore runs: try again at a later pass
            storage.child(folder).delete(plan.new_data)
            log.info("%s/%s: compaction postponed (a save or restore is running)", storage.url, folder)
            return moved
        if not done:
            return moved
        log.info("%s/%s: kept %d of %d bytes as %s", storage.url, folder, plan.new_size, plan.size, plan.new_data)
        moved.append(f"{folder}/{plan.data}")
        kept = read_kept(storage, kept) or {}
        if not kept:
            return moved
    _sweep(storage, kept)
    return moved
