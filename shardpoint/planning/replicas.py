"""The replica comparison: pure decisions over the rows of digests that ranks send.

Each rank describes every copy it holds that other ranks may hold too as a
:class:`Row` (which piece of which tensor, in which declared group, its
digest). The rows travel as an int64 table (:func:`encode_rows`); a table
that shows nothing :func:`suspicious` ends the comparison, and only then do
the named rows travel, from which :func:`mismatches` names the differing
tensors and :func:`copied_names` the names several declared groups hold.

Where the tables travel is the save's business
(:mod:`shardpoint.saving.replicas`): the digests are compared at the commit
(:func:`commit_refusal`), where each rank's status carries its table's
digest and rank 0 fetches one table per distinct digest, like the
documents of :mod:`shardpoint.planning.commit`; where declared groups may
get per-group copy names, tables without digests travel before the write
to find them (:func:`copied_names`).

Example::

    if suspicious([encode_rows(a), encode_rows(b)]):
        error = refusal([a, b], "ckpt/step_100")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
import xxhash

from ..errors import ReplicaMismatchError

__all__ = [
    "COPY_MARK", "Row", "ReplicaTable", "mismatches", "copied_names", "copy_name", "parse_copy_name", "copies_of", "encode_rows",
    "suspicious", "replica_message", "mismatch_error", "refusal", "table_representatives", "commit_refusal",
]

COPY_MARK = "@ranks"


@dataclass(frozen=True)
class Row:
    """One held copy as the ranks compare it: which piece of which tensor, in which declared group, its digest."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int] | None
    group: str
    digest: tuple[int, ...]

    @property
    def piece(self) -> tuple:
        return (self.fqn, self.offsets, self.sizes, self.flat)


@dataclass(frozen=True)
class ReplicaTable:
    """A rank's rows for the comparison at the commit.

    ``encoded``: the int64 ``[n, 6]`` table (:func:`encode_rows`) as bytes,
    sent with the rank's status; ``held``: each row's fields as a plain
    tuple (``Row(*fields)``), sent only when rank 0 finds the tables
    :func:`suspicious`.

    Example::

        ReplicaTable.of([("w", (0,), (4,), None, "", (0, 1, 2, 3))]).rows()
    """

    encoded: bytes
    held: tuple[tuple, ...]

    @staticmethod
    def of(held: Sequence[tuple]) -> "ReplicaTable":
        """The table of rows given as tuples of :class:`Row`'s fields (or as rows)."""
        held = tuple(tuple(h) if isinstance(h, tuple) else (h.fqn, h.offsets, h.sizes, h.flat, h.group, h.digest) for h in held)
        return ReplicaTable(_encode(held).tobytes(), held)

    def rows(self) -> list[Row]:
        """The rows, named."""
        return [Row(*h) for h in self.held]

    def digest(self) -> str:
        """xxh3_128 of the encoded table: equal on ranks that hold the same pieces with the same values."""
        return xxhash.xxh3_128_hexdigest(self.encoded)


def mismatches(table: Sequence[Sequence[Row]]) -> list[tuple[str, list[list[int]]]]:
    """Per tensor whose copies differ within one declared group: its name and the ranks of each distinct value.

    ``table[r]`` is rank ``r``'s rows. Pure: every rank computes the same answer.

    Example::

        mismatches([[Row("w", (0,), (4,), None, "", (0, 1, 2, 3))], [Row("w", (0,), (4,), None, "", (0, 4, 5, 6))]])
        # [("w", [[0], [1]])]
    """
    seen: dict[tuple, dict[tuple[int, ...], list[int]]] = {}
    for rank, rows in enumerate(table):
        for row in rows:
            seen.setdefault((*row.piece, row.group), {}).setdefault(row.digest, []).append(rank)
    out: dict[str, list[list[int]]] = {}
    for key, by_digest in seen.items():
        kinds = {d[0] for d in by_digest}
        if len(by_digest) > len(kinds) and key[0] not in out:  # two values digested the same way
            out[key[0]] = sorted(sorted(r) for r in by_digest.values())
    return sorted(out.items())


def _ranks(group: str) -> list[int]:
    return sorted(int(r) for r in group.split(",")) if group else []


def copied_names(table: Sequence[Sequence[Row]]) -> dict[str, list[str]]:
    """Names that ranks of several declared groups hold as the same piece: name -> the groups.

    Each such group keeps its own copy. Raises :class:`ReplicaMismatchError`
    where the groups overlap or one of them is the whole group, since no
    declaration can then say which copy a rank holds.

    Example::

        copied_names([[Row("w", (), (), None, "0", (0, 1, 1, 1))], [Row("w", (), (), None, "1", (0, 2, 2, 2))]])
        # {"w": ["0", "1"]}
    """
    groups: dict[tuple, set[str]] = {}
    for rows in table:
        for row in rows:
            groups.setdefault(row.piece, set()).add(row.group)
    out: dict[str, list[str]] = {}
    for piece, gs in groups.items():
        if len(gs) < 2:
            continue
        members = [set(g.split(",")) if g else None for g in gs]
        if any(m is None for m in members) or sum(len(m) for m in members) != len(set().union(*members)):
            raise ReplicaMismatchError(
                f"tensor {piece[0]!r} is declared with overlapping replica groups {sorted(gs)} on different ranks; "
                "pass the same replicated_over on every rank, each rank naming the ranks that hold its copy",
                piece[0], [_ranks(g) for g in sorted(gs)],
            )
        out[piece[0]] = sorted(gs)
    return out


def copy_name(fqn: str, group: str) -> str:
    """The stored name of the copy of ``fqn`` that the ranks ``group`` (``"0,1"``) hold.

    Example::

        copy_name("model.experts.w", "2,3")  # 'model.experts.w@ranks2,3'
    """
    return f"{fqn}{COPY_MARK}{group}"


def parse_copy_name(name: str) -> tuple[str, frozenset[int]] | None:
    """``(fqn, ranks)`` of a copy's stored name, or ``None`` for an ordinary name.

    Example::

        parse_copy_name("model.experts.w@ranks2,3")  # ('model.experts.w', frozenset({2, 3}))
    """
    head, mark, tail = name.rpartition(COPY_MARK)
    if not mark or not head:
        return None
    try:
        return head, frozenset(int(r) for r in tail.split(","))
    except ValueError:
        return None


def copies_of(names: Iterable[str], rank: int) -> dict[str, str]:
    """Among a checkpoint's tensor ``names``, the copies global ``rank``'s group saved: ordinary name -> copy name.

    Example::

        copies_of(["w@ranks0,1", "w@ranks2,3", "b"], 3)  # {'w': 'w@ranks2,3'}
    """
    picked = {}
    for name in names:
        parsed = parse_copy_name(name)
        if parsed is not None and rank in parsed[1]:
            picked[parsed[0]] = name
    return picked


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def _key(*parts: Any) -> int:
    return _signed(xxhash.xxh3_64_intdigest(repr(parts).encode()))


def _encode(held: Sequence[tuple]) -> np.ndarray:
    top, wrap = 1 << 63, 1 << 64  # unsigned 64-bit digests as int64
    data = []
    for fqn, offsets, sizes, flat, group, (kind, a, b, c) in held:
        a, b, c = int(a), int(b), int(c)
        data.append((
            _key(fqn, offsets, sizes, flat), _key(group), int(kind),
            a - wrap if a >= top else a, b - wrap if b >= top else b, c - wrap if c >= top else c,
        ))
    return np.array(data, dtype=np.int64).reshape(-1, 6)


def encode_rows(rows: Sequence[Row]) -> torch.Tensor:
    """``rows`` as an int64 ``[n, 6]`` table: piece key, group key and the four digest fields.

    The fast path of the check sends this table (no pickled objects); names
    travel only when the keys show a mismatch or a name held by several groups.

    Example::

        encode_rows(rows_of(tensors)).shape  # (n, 6)
    """
    return torch.from_numpy(_encode([(*r.piece, r.group, r.digest) for r in rows]))


def _array(table: Any) -> np.ndarray:
    if isinstance(table, (bytes, bytearray, memoryview)):
        return np.frombuffer(table, dtype=np.int64).reshape(-1, 6)
    return np.asarray(table.numpy() if isinstance(table, torch.Tensor) else table, dtype=np.int64).reshape(-1, 6)


def suspicious(tables: Sequence[Any]) -> bool:
    """Whether encoded tables (one per rank) show two values of one piece in one group, or one piece in two groups.

    A table is an int64 ``[n, 6]`` tensor (:func:`encode_rows`) or its bytes
    (:attr:`ReplicaTable.encoded`). Vectorized: rank 0 runs it over every
    rank's table at the commit.

    Example::

        suspicious([encode_rows(a), encode_rows(b)])
    """
    arrays = [a for a in (_array(t) for t in tables) if len(a)]
    if not arrays:
        return False
    distinct = np.unique(np.concatenate(arrays), axis=0)  # one row per (piece, group, digest)
    held = np.unique(distinct[:, :2], axis=0)  # one row per (piece, group)
    return len(held) < len(distinct) or len(np.unique(held[:, 0])) < len(held)


def replica_message(where: str, fqn: str, groups: list[list[int]], others: Sequence[str]) -> str:
    """The message of the :class:`ReplicaMismatchError` for ``fqn``, whose ranks ``groups`` hold different values.

    Example::

        replica_message("ckpt/step_100", "model.experts.0.w", [[0], [1]], [])
    """
    shown = "; ".join(f"ranks {g}" for g in groups)
    more = f" (also differing: {list(others[:8])}{' ...' if len(others) > 8 else ''})" if others else ""
    return (
        f"{where}: tensor {fqn!r} is to be saved as one copy for the ranks holding it, but their copies differ "
        f"({len(groups)} distinct values: {shown}){more}; saving would keep one rank's values and lose the others'. "
        "Say which ranks hold the same copy with replicated_over (a group, or patterns over tensor names such "
        "as {'model.experts.*': expert_group}), or declare the tensor's layout (sp.Experts for expert-parallel "
        "local experts, a DTensor for sharded state)"
    )


def mismatch_error(table: Sequence[Sequence[Row]], where: str) -> ReplicaMismatchError | None:
    """The error for the first tensor whose copies differ within a group (``table[r]``: rank ``r``'s rows), or ``None``.

    Example::

        err = mismatch_error([rows0, rows1], "ckpt/step_100")
    """
    bad = mismatches(table)
    if not bad:
        return None
    fqn, groups = bad[0]
    return ReplicaMismatchError(replica_message(where, fqn, groups, [n for n, _ in bad[1:]]), fqn, groups)


def refusal(table: Sequence[Sequence[Row]], where: str) -> ReplicaMismatchError | None:
    """The verdict on every rank's named rows (``table[r]``: rank ``r``'s): the error to fail with, or ``None``.

    Differing copies within a group are refused, and so is a name that the
    ranks of several groups hold: without a declaration (``replicated_over``)
    the save wrote it under one name, so only one group's copy would load.

    Example::

        err = refusal([rows0, rows1], "ckpt/step_100")
    """
    err = mismatch_error(table, where)
    if err is not None:
        return err
    copies = copied_names(table)
    if not copies:
        return None
    fqn = sorted(copies)[0]
    groups = [_ranks(g) for g in copies[fqn]]
    return ReplicaMismatchError(
        f"{where}: tensor {fqn!r} is held by the ranks of {len(groups)} replica groups ({groups}), which may hold "
        "different values, but the save was not told so and would store one copy for all. Pass replicated_over "
        "on every rank, naming the ranks that hold this rank's copy (a group, or patterns over tensor names), so "
        "that each group's copy is stored", fqn, groups,
    )


def table_representatives(digests: Sequence[str]) -> frozenset[int]:
    """The lowest rank of each distinct replica table digest (``digests[r]``: rank ``r``'s; empty: no table).

    Ranks whose tables are equal hold the same pieces with the same values
    (every rank of a DDP job, say), so the commit fetches one table of each.

    Example::

        table_representatives(["a", "a", "b", ""])  # frozenset({0, 2})
    """
    first: dict[str, int] = {}
    for r, d in enumerate(digests):
        if d:
            first.setdefault(d, r)
    return frozenset(first.values())


def commit_refusal(digests: Sequence[str], tables: Mapping[int, ReplicaTable], where: str) -> ReplicaMismatchError | None:
    """Rank 0's verdict at the commit, from each rank's table digest and the representatives' ``tables``.

    ``tables`` maps each rank of :func:`table_representatives` to its
    table. Only when the distinct tables are :func:`suspicious` are rows
    compared by name, each rank taking its representative's rows.

    Example::

        err = commit_refusal(["a", "b"], {0: table0, 1: table1}, "ckpt/step_100")
    """
    rep = {d: r for r, d in reversed(list(enumerate(digests))) if d}  # the lowest rank of each digest
    if not suspicious([tables[r].encoded for r in rep.values()]):
        return None
    rows = {d: tables[r].rows() for d, r in rep.items()}
    return refusal([rows[d] if d else [] for d in digests], where)
