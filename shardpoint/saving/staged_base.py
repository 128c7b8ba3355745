"""Incremental background saves: the staged writer compares each chunk with its base before writing it.

An asynchronous save with ``base=`` (:class:`~shardpoint.AsyncSaver`, or a
:class:`~shardpoint.CheckpointManager` with ``incremental=True``) opens its
base on the writer, in the background, once the path is claimed: nothing
is read on the training thread. The writer then drains the staging ring as
always, but hands every piece to a :class:`StagedReuse` first. For a chunk
with a candidate at the same place in the base (the rules of
:mod:`shardpoint.saving.incremental`), it holds the chunk's staged pieces
(the state as of the call) and hashes them: at the first block whose
checksum differs from the base's, the held pieces are written, with the
checksums already computed, and the rest of the chunk streams as usual;
with every block equal the chunk is referenced and its pieces released
unwritten. A chunk is held only where it fits in the ring beside one more
piece (``nbytes + piece <= capacity``): a larger one (a ring smaller than
the state, set with ``staging_bytes``) is written in full, as holding it
would stall the copier.

Before the reference index files are written, the writer checks that every
data file it references still exists, so a base removed by hand while the
save ran fails the save instead of committing references to missing data.

Example::

    reuse = StagedReuse(open_base(base, storage, where), block=1 << 22, rank=0).attach(write)
    write.write()
    refs = reuse.finish(storage, save_id, dtypes, where)
"""

from __future__ import annotations

from typing import Any, Mapping

from ..engine.pipeline import Staged
from ..engine.staging import Slot, StagingRing
from ..errors import MissingBaseError, StorageError
from ..format.datafile import BlockHasher, DataFileWriter
from ..format.manifest import ChunkMeta
from ..format.refs import RefFiles
from ..items import SaveTensor
from ..storage import Storage
from ..storage.locations import locate
from .incremental import BaseCheckpoint, Reused, candidate_chunk, reused_chunk, write_references

__all__ = ["StagedReuse"]


class StagedReuse:
    """The staged writer's comparison with the base: it takes the pieces of chunks the base may hold.

    :meth:`take` is called with every staged piece before the writer writes
    it (see :attr:`~shardpoint.engine.pipeline.StagedWrite.chooser`);
    :attr:`reused` lists the chunks referenced so far.

    Example::

        reuse = StagedReuse(base, block=1 << 22, rank=0).attach(write)
    """

    def __init__(self, base: BaseCheckpoint, block: int, rank: int):
        self.base = base
        self.block = block
        self.rank = rank
        self.ring: StagingRing | None = None  # the staged write's (see attach)
        self.piece = 0
        self.items: Any = ()
        self.records: list = []
        self.reused: list[Reused] = []
        self._chunk: ChunkMeta | None = None  # the base's chunk the held item is compared with
        self._hasher: BlockHasher | None = None
        self._held: list[Slot] = []

    def take(self, msg: Staged, out: DataFileWriter, sink: Any) -> bool:
        """Hold, write or reference one staged slot's parts; ``False``: not taken, the caller writes it.

        A slot of several small items (a batch) is compared item by item at
        once; a piece of a larger item is held until its chunk is decided.
        """
        if len(msg.parts) > 1:
            self._take_batch(msg, out, sink)
            return True
        i, off, _, final = msg.parts[0]
        it: SaveTensor = self.items[i]
        if off == 0:
            self._chunk = self._held_candidate(it)
            self._hasher = BlockHasher(self.block) if self._chunk is not None else None
        if self._chunk is None or msg.slot is None:
            return False
        msg.event.synchronize()  # the copy into the slot is complete
        self._held.append(msg.slot)
        self._hasher.update(memoryview(msg.slot.view.numpy()))
        want = self._chunk.checksums
        done = self._hasher.finished()
        differs = len(done) > len(want) or tuple(done) != tuple(want[: len(done)])
        if not differs and final:
            differs = tuple(self._hasher.digests()) != tuple(want)
            if not differs:
                self.reused.append(reused_chunk(self.base, it.fqn, self._chunk, self.rank))
                self._release(sink)
                self._chunk = None
                return True
        if differs:
            self._write_held(it, out, sink, final)
        return True

    def _take_batch(self, msg: Staged, out: DataFileWriter, sink: Any) -> None:
        """Small whole items sharing one slot: each referenced when its bytes equal the base's chunk, else written."""
        mv = None
        if msg.slot is not None:
            msg.event.synchronize()
            mv = memoryview(msg.slot.view.numpy())
        pos = 0
        for i, _, n, _ in msg.parts:
            it: SaveTensor = self.items[i]
            data, pos = (mv[pos : pos + n] if n else b""), pos + n
            chunk = candidate_chunk(self.base, it, self.block) if n else None
            hasher = None
            if chunk is not None:
                hasher = BlockHasher(self.block)
                hasher.update(data)
                if tuple(hasher.digests()) == tuple(chunk.checksums):
                    self.reused.append(reused_chunk(self.base, it.fqn, chunk, self.rank))
                    continue
            out.begin(hasher)
            if n:
                out.write(data, hashed=hasher is not None)
            self.records.append((it.fqn, out.end(it.box, it.flat)))
        if msg.slot is not None:
            self._held.append(msg.slot)
            self._release(sink)

    def _held_candidate(self, it: SaveTensor) -> ChunkMeta | None:
        """The base's chunk at ``it``'s place, when ``it`` may be held whole in the ring beside one more piece."""
        if it.nbytes == 0 or it.nbytes + self.piece > self.ring.capacity:
            return None
        return candidate_chunk(self.base, it, self.block)

    def _write_held(self, it: SaveTensor, out: DataFileWriter, sink: Any, final: bool) -> None:
        """The chunk differs: write the held pieces with the checksums computed so far; the rest streams as usual."""
        out.begin(self._hasher)
        for slot in self._held:
            out.write(memoryview(slot.view.numpy()), hashed=True)
        self._release(sink)
        self._chunk = None
        if final:  # the last piece was among the held ones: the chunk ends here
            self.records.append((it.fqn, out.end(it.box, it.flat)))

    def _release(self, sink: Any) -> None:
        """Give the held slots back, after whatever the sink still writes (releases are in ring order)."""
        held, self._held = self._held, []
        for slot in held:
            if sink is None:
                self.ring.release(slot)
            else:
                sink.then(lambda s=slot: self.ring.release(s))

    def attach(self, write: Any) -> "StagedReuse":
        """Take the pieces of ``write`` (a :class:`~shardpoint.engine.pipeline.StagedWrite`) first; return ``self``.

        Example::

            StagedReuse(base, block=1 << 22, rank=0).attach(write)
        """
        self.ring, self.piece = write.ring, write.piece
        self.items = write.items
        self.records = write.records
        write.chooser = self
        return self

    def finish(self, storage: Storage, save_id: str, dtypes: Mapping[str, str], where: str) -> tuple[tuple[RefFiles, ...], dict[str, int]]:
        """After the data file: check the referenced data files are still there, then write the references' index files.

        Raises :class:`~shardpoint.errors.MissingBaseError` naming the base
        when one is gone or changed (removed while the save ran).
        """
        if not self.reused:
            return (), {}
        for base, data, size in sorted({(r.base, r.data, r.size) for r in self.reused}):
            holder = self.base.storage if base == self.base.to_base else locate(storage, base)
            try:
                ok = holder.size(data) == size
            except (FileNotFoundError, StorageError):
                ok = False
            if not ok:
                raise MissingBaseError(
                    f"{where}: the base {self.base.storage.url} changed or was removed while this save ran ({base}/{data} "
                    "is gone); save again, with another base= or none", base, holder.url,
                )
        return write_references(storage, save_id, self.rank, self.reused, dtypes)
