"""Checking a checkpoint's data against its checksums, without loading it (``shardpoint verify``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..api import read_manifest
from ..engine.indexes import IndexReader
from ..engine.io import verify_chunk
from ..engine.references import open_references
from ..errors import CheckpointError
from ..storage import storage_for
from .options import progress

__all__ = ["verify_checkpoint"]


def verify_checkpoint(path: str, jobs: int = 4, quiet: bool = True) -> tuple[int, list[str]]:
    """Check every data file and chunk checksum of ``path``; return (chunks checked, problems).

    Damage (a missing, truncated or unsafe data file, a bad index file, a
    chunk failing its checksum) is listed in ``problems``, one line each;
    unreadable metadata raises a :class:`~shardpoint.errors.CheckpointError`.
    ``jobs`` threads check chunks in parallel; ``quiet=False`` shows progress.

    Example::

        n, problems = verify_checkpoint("ckpt/step_100")
        assert not problems, problems
    """
    storage = storage_for(path)
    m = read_manifest(storage, chunks=False)  # unreadable metadata is an error (exit 2), not damage found
    problems: list[str] = []
    for name, size in m.files.items():
        try:
            real = storage.size(name)
        except FileNotFoundError:
            problems.append(f"missing data file {name}")
            continue
        except CheckpointError as e:  # a link, FIFO or device in place of a file
            problems.append(str(e))
            continue
        if real < size:
            problems.append(f"data file {name} is truncated: {real} of {size} bytes")
    try:  # referenced data files of an incremental checkpoint: in their bases, checked like its own
        storage = open_references(storage, m, storage.url)
    except CheckpointError as e:
        return 0, [*problems, str(e)]
    work = []
    reader = IndexReader(storage, m, storage.url)
    for fqn, t in m.tensors.items():
        try:  # a missing, unsafe or damaged index file is damage found, reported once
            chunks = t.chunks if t.chunks is not None else reader.chunks(fqn)
        except CheckpointError as e:
            if str(e) not in problems:
                problems.append(str(e))
            continue
        work.extend((fqn, c) for c in chunks)
    def check(item):
        fqn, c = item
        try:
            verify_chunk(storage, m, fqn, c)
            return None
        except (CheckpointError, OSError) as e:
            return str(e)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        with progress(len(work), "verify", quiet, unit="chunk") as bar:
            for err in pool.map(check, work):
                bar.update(1)
                if err:
                    problems.append(err)
    return len(work), problems
