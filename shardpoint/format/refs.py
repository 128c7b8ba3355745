"""References: chunks a checkpoint uses from another checkpoint's data file (format version 4).

An incremental save (``sp.save(path, state, base=prev)``) writes only the
chunks whose bytes changed since ``prev``; every other chunk stays where it
lies and the new checkpoint *references* it. A reference is one
:class:`RefFiles` per (writer rank, referenced data file): the data file is
named by ``base`` (where the checkpoint that physically holds it lies,
relative to the referencing checkpoint, e.g. ``../step_100``) and ``data``
(its name there, e.g. ``data/ab12-r00000.bin``); its chunk records live in
an index file of the referencing checkpoint (``index``, with ``digest``), in
the same binary layout as every index (:mod:`shardpoint.format.index`).

References are flat: ``base`` always names the checkpoint that *holds* the
bytes, never an intermediate one, so a chain C -> B -> A resolves in one
step and removing B never breaks C. :func:`join_base` composes the
locations when a save reuses a chunk that its base itself referenced.

Example::

    ref = RefFiles(0, "../step_100", "data/ab12-r00000.bin", 4096, "data/cd34-r00000-ref0.idx", "0" * 32)
    assert ref.name == "../step_100/data/ab12-r00000.bin"
    assert join_base("../step_200", "../step_100") == "../step_100"
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import FormatError
from .records import check_file_name

__all__ = ["REF_VERSION", "RefFiles", "check_base", "join_base", "parse_refs", "ref_index_name"]

# The manifest version that carries references; a save with none writes the previous version, unchanged.
REF_VERSION = 4

_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"[0-9a-f]{32}")
_DATA = re.compile(r"data/[0-9a-f]{8,64}-r[0-9]{5,8}\.bin")
MAX_BASE_PARTS = 32


def check_base(base: str, where: str = "") -> str:
    """Refuse a base location that is not ``..`` steps followed by plain folder names.

    A base is relative to the referencing checkpoint and must leave it
    (it starts with ``..``); it never has ``.`` or empty parts, and no
    ``..`` after a folder name, so it names a sibling or cousin folder only.

    The one other base is ``.``: the checkpoint's own folder, where
    :func:`shardpoint.consolidate` copies what it referenced.

    Example::

        >>> check_base("../step_100")
        '../step_100'
    """
    if base == ".":
        return base
    parts = base.split("/") if isinstance(base, str) else []
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    rest = parts[ups:]
    if not ups or not rest or len(parts) > MAX_BASE_PARTS or not all(_PART.fullmatch(p) for p in rest):
        prefix = f"{where}: " if where else ""
        raise FormatError(f"{prefix}malformed base location {base!r}: it must be '../' steps then folder names")
    return base


def join_base(to_prev: str, prev_ref: str) -> str:
    """The location of ``prev_ref`` (relative to the base) as seen from the new checkpoint (``to_prev`` away).

    Example::

        >>> join_base("../step_200", "../step_100")
        '../step_100'
        >>> join_base("../../runB/step_2", "../step_1")
        '../../runB/step_1'
    """
    return check_base(posixpath.normpath(posixpath.join(to_prev, prev_ref)))


def ref_index_name(save_id: str, rank: int, k: int) -> str:
    """The name of rank ``rank``'s ``k``-th reference index file in save ``save_id``.

    Example::

        >>> ref_index_name("ab12", 3, 0)
        'data/ab12-r00003-ref0.idx'
    """
    return f"data/{save_id}-r{rank:05d}-ref{k}.idx"


@dataclass(frozen=True)
class RefFiles:
    """The chunks rank ``rank`` references in data file ``data`` of the checkpoint at ``base``.

    ``size`` is that data file's size (checked before any load reads it);
    ``index`` is this checkpoint's index file of those chunks and ``digest``
    its xxh3_128, as for :class:`~shardpoint.format.manifest.RankFiles`.

    Example::

        ref = RefFiles(0, "../step_100", "data/ab12-r00000.bin", 4096, "data/cd34-r00000-ref0.idx", "0" * 32)
        ref.name   # '../step_100/data/ab12-r00000.bin': what the chunk records name
    """

    rank: int
    base: str
    data: str
    size: int
    index: str
    digest: str

    @property
    def name(self) -> str:
        """The referenced data file as the chunk records name it: ``base/data``."""
        return f"{self.base}/{self.data}"

    def to_json(self) -> list:
        """The manifest's entry: ``[rank, base, data, size, index, digest]``."""
        return [self.rank, self.base, self.data, self.size, self.index, self.digest]


def parse_refs(doc: Any, files: Mapping[str, int], world: int, where: str) -> tuple[RefFiles, ...]:
    """Validate a manifest's ``refs`` member (untrusted input): its :class:`RefFiles`.

    Example::

        refs = parse_refs([[0, "../s1", "data/ab12cd34-r00000.bin", 64, "data/x-r00000-ref0.idx", "0" * 32]],
                          {"data/x-r00000-ref0.idx": 80}, 1, "ckpt")
    """
    if not isinstance(doc, list) or len(doc) > world * 4096:
        raise FormatError(f"{where}: 'refs' must be a list of at most {world * 4096} entries")
    out = []
    for i, e in enumerate(doc):
        what = f"{where}: reference {i}"
        if not isinstance(e, list) or len(e) != 6:
            raise FormatError(f"{what} must be [rank, base, data file, size, index file, digest]")
        rank, base, data, size, index, digest = e
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
            raise FormatError(f"{what}: rank {rank!r} is not a rank of this checkpoint")
        if not isinstance(data, str) or not _DATA.fullmatch(data):
            raise FormatError(f"{what}: {data!r} is not a data file name")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 1 << 62:
            raise FormatError(f"{what}: malformed size {size!r}")
        if check_file_name(index, what) not in files:
            raise FormatError(f"{what} names unlisted index file {index!r}")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise FormatError(f"{what}: malformed index digest {digest!r}")
        out.append(RefFiles(rank, check_base(base, what), data, size, index, digest))
    return tuple(out)
