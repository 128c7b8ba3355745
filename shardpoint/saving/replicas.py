"""The replica check at save: ranks that are to hold the same copy of a tensor prove it.

A plain tensor is written once per replica group, so a rank whose copy
differs from the written one would lose its values in silence. Before any
data is written each rank computes a small digest of every copy it holds
where the data lives, the digests of all tensors travel in one gather, and
every rank compares the same table and reaches the same verdict.

Digests (:mod:`shardpoint.saving.digest`) compare bit patterns: on the CPU an
``xxh3_64`` of the whole tensor up to 64 KiB, else of a strided sample that
always includes elements from every stretch of the tensor; on an accelerator,
torch ops on the device (a sample plus the exact sum of every bit pattern).
Copies that differ everywhere, such as per-rank expert weights, are always
caught. The gather sends int64 tables only; names follow in a second gather
only when the tables show a mismatch or a name held by several groups.

The same table tells where ranks of different declared groups hold one name
with possibly different values: those tensors are stored as one copy per
group, named ``<name>@ranks<r0>,<r1>,...`` (:func:`copy_name`), and a load
takes the copy whose ranks include its own (:func:`copy_rule`).

Example::

    tensors = check_replicas(tensors, comm, "ckpt/step_100")
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import torch
import xxhash

from .digest import HOST, check_mode, digest_all
from ..errors import ReplicaMismatchError
from ..items import SaveTensor
from ..layouts import WholeRule

__all__ = [
    "COPY_MARK", "Row", "rows_of", "mismatches", "copied_names", "encode_rows", "suspicious", "Gate", "FAILED",
    "copy_name", "parse_copy_name", "check_replicas", "CopyRule", "copy_rule", "with_copies",
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


def _checked(t: SaveTensor) -> bool:
    # Copies compared: every replicated piece, and plain tensors a rank holds alone
    # (another group may hold the same name: see copied_names).
    return t.replica_count > 1 or t.placement == "local"


def rows_of(tensors: Iterable[SaveTensor], digests: bool = True) -> list[Row]:
    """This rank's :class:`Row` for every tensor it holds that other ranks may hold too.

    ``digests=False`` leaves every digest equal (the check is off; the rows
    still find names held by several groups).

    Example::

        rows = rows_of(prep.tensors)
    """
    held = [t for t in tensors if _checked(t)]
    digests = digest_all([t.data for t in held]) if digests else [(HOST, 0, 0, 0)] * len(held)
    return [Row(t.fqn, tuple(t.box.offsets), tuple(t.box.sizes), t.flat, t.replica_group, d) for t, d in zip(held, digests)]


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
                piece[0], [sorted(int(r) for r in g.split(",")) if g else [] for g in sorted(gs)],
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


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def _key(*parts: Any) -> int:
    return _signed(xxhash.xxh3_64_intdigest(repr(parts).encode()))


def encode_rows(rows: Sequence[Row]) -> torch.Tensor:
    """``rows`` as an int64 ``[n, 6]`` table: piece key, group key and the four digest fields.

    The fast path of the check sends this table (no pickled objects); names
    travel only when the keys show a mismatch or a name held by several groups.

    Example::

        encode_rows(rows_of(tensors)).shape  # (n, 6)
    """
    data = [[_key(*r.piece), _key(r.group), *(_signed(int(d)) for d in r.digest)] for r in rows]
    return torch.tensor(data, dtype=torch.int64).reshape(-1, 6)


def suspicious(tables: Sequence[torch.Tensor]) -> bool:
    """Whether encoded tables (one per rank) show two values of one piece in one group, or one piece in two groups.

    Example::

        suspicious([encode_rows(a), encode_rows(b)])
    """
    values: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    groups: dict[int, set[int]] = {}
    for table in tables:
        for piece, group, *digest in table.tolist():
            values.setdefault((piece, group), set()).add(tuple(digest))
            groups.setdefault(piece, set()).add(group)
    return any(len(v) > 1 for v in values.values()) or any(len(g) > 1 for g in groups.values())


FAILED = -(1 << 63)  # the piece key of the marker row a failed rank sends


class Gate:
    """The gathers of one save's preparation, which a rank that fails before them still joins.

    Every rank calls :meth:`gather` the same number of times while its
    preparation goes well. A rank that fails calls :meth:`abstain`, which
    joins the next gather with a marker row; every rank then sees the
    marker, skips the remaining gathers and the checks, and the failing
    rank's own error reaches all of them at the commit. :meth:`close` marks
    the last gather done, after which a failure needs no marker.

    Example::

        gate = Gate(comm)
        tables = gate.gather(encode_rows(rows))  # None: a rank failed
    """

    def __init__(self, comm: Any):
        self.comm = comm
        # A stand-in without a process group (a simulation of many ranks in one process) gathers nothing.
        self.active = bool(getattr(comm, "active", False)) and comm.world > 1
        self.failed = False
        self.closed = False

    def gather(self, table: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's int64 ``[n, 6]`` table, or ``None`` once any rank has failed."""
        if not self.active:
            return [table]
        if self.failed or self.closed:
            return None
        tables = self.comm.all_gather_rows(table)
        if any(bool((t[:, 0] == FAILED).any()) for t in tables if t.numel()):
            self.failed = True
            return None
        return tables

    def abstain(self) -> None:
        """This rank failed: join one gather with the marker, unless the gathers are over."""
        if self.active and not self.failed and not self.closed:
            self.failed = True
            self.comm.all_gather_rows(torch.full((1, 6), FAILED, dtype=torch.int64))

    def close(self) -> None:
        """The last gather is done."""
        self.closed = True


def _message(where: str, fqn: str, groups: list[list[int]], others: list[str]) -> str:
    shown = "; ".join(f"ranks {g}" for g in groups)
    more = f" (also differing: {others[:8]}{' ...' if len(others) > 8 else ''})" if others else ""
    return (
        f"{where}: tensor {fqn!r} is to be saved as one copy for the ranks holding it, but their copies differ "
        f"({len(groups)} distinct values: {shown}){more}; saving would keep one rank's values and lose the others'. "
        "Say which ranks hold the same copy with replicated_over (a group, or patterns over tensor names such "
        "as {'model.experts.*': expert_group}), or declare the tensor's layout (sp.Experts for expert-parallel "
        "local experts, a DTensor for sharded state)"
    )


def check_replicas(tensors: list[SaveTensor], comm: Any, where: str, gate: Gate | None = None) -> list[SaveTensor]:
    """Compare every rank's copies; raise on a mismatch, store per-group copies apart.

    Returns ``tensors`` itself when no name is held by several groups, else
    a list in which those tensors carry their copy names. Every rank reaches
    the same verdict, so every rank raises the same error. ``gate`` carries
    the gathers of the preparation (see :class:`Gate`); this is its last.

    Example::

        tensors = check_replicas(tensors, comm, "ckpt/step_100")
    """
    gate = gate if gate is not None else Gate(comm)
    if not gate.active:
        gate.close()
        return tensors
    failure: Exception | None = None
    try:
        mine = rows_of(tensors, check_mode() != "off")
        encoded = encode_rows(mine)
    except Exception as e:  # noqa: BLE001 - the gather must still happen on every rank
        failure, mine, encoded = e, [], torch.full((1, 6), FAILED, dtype=torch.int64)
    # Fast path: int64 tables only. Every rank sees the same tables, so all take the slow path or none.
    tables = gate.gather(encoded)
    gate.close()
    if failure is not None:
        raise failure
    if tables is None or not suspicious(tables):
        return tensors  # nothing to compare, or a rank failed and the commit reports its error
    table = comm.all_gather(mine)
    bad = mismatches(table)
    if bad:
        fqn, groups = bad[0]
        raise ReplicaMismatchError(_message(where, fqn, groups, [n for n, _ in bad[1:]]), fqn, groups)
    copies = copied_names(table)
    if not copies:
        return tensors
    return [replace(t, fqn=copy_name(t.fqn, t.replica_group)) if t.fqn in copies else t for t in tensors]


class CopyRule(WholeRule):
    """A load rule that reads each name this rank's group saved as its own copy from that copy.

    Built by :func:`copy_rule`; ``names`` maps an ordinary name to the
    stored copy name. The geometry is the identity: only names change.

    Example::

        CopyRule({"model.experts.w": "model.experts.w@ranks2,3"})
    """

    def __init__(self, names: Mapping[str, str]):
        self.names = dict(names)
        self.pattern = ""
        self.dim = 0

    def param_match(self, fqn: str) -> tuple[str, str, str] | None:
        return ("", fqn, "") if fqn in self.names else None

    def logical_name(self, param: str, part: str) -> str:
        return self.names[param]



def copy_rule(names: Iterable[str], rank: int) -> CopyRule | None:
    """The :class:`CopyRule` for global ``rank`` over a checkpoint's tensor ``names``; ``None`` if it saved no copies.

    Example::

        rule = copy_rule(manifest.tensors, dist.get_rank())
    """
    picked = {}
    for name in names:
        parsed = parse_copy_name(name)
        if parsed is not None and rank in parsed[1]:
            picked[parsed[0]] = name
    return CopyRule(picked) if picked else None


def with_copies(layouts: Sequence[Any], names: Iterable[str]) -> list[Any]:
    """``layouts`` plus the :class:`CopyRule` of the calling process's global rank, when the checkpoint saved copies.

    Example::

        rules = with_copies(layouts, manifest.tensors)
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    rule = copy_rule(names, rank)
    return list(layouts) if rule is None else [*layouts, rule]
