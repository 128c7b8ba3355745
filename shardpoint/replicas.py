"""The replica check at save: ranks that are to hold the same copy of a tensor prove it.

A plain tensor is written once per replica group, so a rank whose copy
differs from the written one would lose its values in silence. Before any
data is written each rank computes a small digest of every copy it holds
where the data lives, the digests of all tensors travel in one gather, and
every rank compares the same table and reaches the same verdict.

Digests compare bit patterns, so ``-0.0`` and ``0.0`` differ and NaNs are
compared exactly:

- a CPU tensor of at most :data:`HOST_FULL_BYTES`: ``xxh3_64`` of all its
  bytes, so any difference is caught; a larger one: ``xxh3_64`` of a strided
  sample of :data:`SAMPLES` elements, one in every ``numel / SAMPLES``-element
  stretch, the first and last included (on the CPU a pass over every byte
  would cost a third of a data-parallel save, whose ranks each write only
  their share of the state). ``SHARDPOINT_REPLICA_CHECK=full`` hashes every
  byte of every tensor; ``off`` skips the check;
- a tensor on an accelerator, with torch ops on its own device (nothing is
  copied to the host but the digest): its elements viewed as integers of the
  same width give the first element's bit pattern (copies that differ
  everywhere, such as expert weights, always differ in it), a
  position-weighted sum of a strided sample of :data:`SAMPLES` elements, one
  in every ``numel / SAMPLES``-element stretch (the last element included),
  and the plain sum of all bit patterns (exact: integer addition wraps the
  same way in any order).

Copies digested both ways (one on the CPU, one on a GPU) cannot be compared
and are passed over.

The same table tells where ranks of different declared groups hold one name
with possibly different values: those tensors are stored as one copy per
group, named ``<name>@ranks<r0>,<r1>,...`` (:func:`copy_name`), and a load
takes the copy whose ranks include its own (:func:`copy_rule`).

Example::

    tensors = check_replicas(tensors, comm, "ckpt/step_100")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import torch
import xxhash

from .errors import ReplicaMismatchError
from .items import SaveTensor
from .layouts import Rule, Segment

__all__ = [
    "SAMPLES", "HOST_FULL_BYTES", "COPY_MARK", "check_mode", "digest_tensor", "digest_all", "Row", "rows_of", "mismatches",
    "copied_names", "encode_rows", "suspicious", "copy_name", "parse_copy_name", "check_replicas", "CopyRule", "copy_rule", "with_copies",
]

SAMPLES = 1024
HOST_FULL_BYTES = 1 << 16
COPY_MARK = "@ranks"
HOST, DEVICE = 0, 1  # the first field of a digest: how it was computed

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a view where torch allows one)."""
    dt = _INT.get(t.element_size())
    if dt is None:  # complex128: 16-byte elements as two 8-byte halves
        return torch.view_as_real(t.resolve_conj()).view(torch.int64)
    if t.dtype == dt:
        return t
    try:
        return t.view(dt)
    except RuntimeError:  # a dtype torch will not reinterpret in place (e.g. a conjugate view)
        return t.resolve_conj().resolve_neg().contiguous().view(dt)


def check_mode() -> str:
    """How much of each CPU tensor the replica check hashes: ``SHARDPOINT_REPLICA_CHECK`` (``sample``, ``full``, ``off``).

    Example::

        check_mode()  # 'sample' unless the environment says otherwise
    """
    mode = os.environ.get("SHARDPOINT_REPLICA_CHECK", "sample").strip().lower() or "sample"
    if mode not in ("sample", "full", "off"):
        raise ValueError(f"SHARDPOINT_REPLICA_CHECK must be 'sample', 'full' or 'off', got {mode!r}")
    return mode


def _sample_index(n: int, device: torch.device, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One index in each of ``min(n, SAMPLES)`` equal stretches of ``[0, n)`` (the last element included), and odd weights."""
    key = (n, device)
    if key not in cache:
        k = min(n, SAMPLES)
        idx = torch.arange(k, dtype=torch.int64) * n // k
        idx[-1] = n - 1
        idx = idx.to(device)
        cache[key] = (idx, idx * 2 + 1)  # odd weights: a swap of two sampled values changes the sum
    return cache[key]


def _host_digest(t: torch.Tensor, full: bool, cache: dict) -> tuple[int, ...]:
    """``xxh3_64`` of a CPU tensor's bytes in row-major order, or of a strided sample of its elements.

    Plain numpy on the tensor's memory: a few microseconds per tensor, where
    each torch op costs tens.
    """
    bits = _bits(t)
    n = bits.numel()
    sample = not full and n * bits.element_size() > HOST_FULL_BYTES
    if not bits.is_contiguous():
        bits = torch.take(bits, _sample_index(n, bits.device, cache)[0]) if sample else bits.contiguous()
        sample = False
    arr = bits.reshape(-1).numpy()
    if sample:
        key = ("np", n)
        if key not in cache:
            cache[key] = _sample_index(n, bits.device, cache)[0].numpy()
        arr = arr[cache[key]]
    return (HOST, xxhash.xxh3_64_intdigest(memoryview(arr).cast("B")) if arr.size else xxhash.xxh3_64_intdigest(b""), n, 0)


def _device_parts(t: torch.Tensor, cache: dict) -> tuple[torch.Tensor, ...]:
    """The three device digest scalars of ``t`` as 0-d int64 tensors on ``t``'s device."""
    bits = _bits(t)
    n = bits.numel()
    if n == 0:
        z = torch.zeros((), dtype=torch.int64, device=t.device)
        return z, z, z
    idx, weights = _sample_index(n, bits.device, cache)
    sample = torch.take(bits, idx).to(torch.int64)
    return sample[0], (sample * weights).sum(), bits.sum(dtype=torch.int64)


def digest_tensor(t: torch.Tensor, host: bool = True) -> tuple[int, ...]:
    """The replica digest of one tensor; see the module documentation.

    ``host=False`` computes a CPU tensor's digest the way an accelerator's
    is computed (for tests of that path).

    Example::

        digest_tensor(torch.ones(4))  # equal for equal bit patterns
    """
    return digest_all([t], host)[0]


def digest_all(tensors: Sequence[torch.Tensor], host: bool = True) -> list[tuple[int, ...]]:
    """Digests of many tensors: CPU ones hashed in place, others on their devices with one host copy per device.

    Example::

        digest_all([w1, w2])  # [(kind, a, b, c), ...]
    """
    out: list[tuple[int, ...]] = [(HOST, 0, 0, 0)] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    parts: dict[int, tuple[torch.Tensor, ...]] = {}
    cache: dict = {}
    full = check_mode() == "full"
    for i, t in enumerate(tensors):
        t = t.detach()
        if host and t.device.type == "cpu":
            out[i] = _host_digest(t, full, cache)
            continue
        parts[i] = _device_parts(t, cache)
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        table = torch.stack([torch.stack(parts[i]) for i in idx]).cpu().tolist()
        for i, row in zip(idx, table):
            out[i] = (DEVICE, int(row[0]), int(row[1]), int(row[2]))
    return out


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
    return t.replica_count > 1 or t.layout == "local"


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


def check_replicas(tensors: list[SaveTensor], comm: Any, where: str) -> list[SaveTensor]:
    """Compare every rank's copies in one gather; raise on a mismatch, store per-group copies apart.

    Returns ``tensors`` itself when no name is held by several groups, else
    a list in which those tensors carry their copy names. Every rank reaches
    the same verdict, so every rank raises the same error.

    Example::

        tensors = check_replicas(tensors, comm, "ckpt/step_100")
    """
    if not comm.active or comm.world == 1:
        return tensors
    try:
        mine: Any = rows_of(tensors, check_mode() != "off")
        encoded = encode_rows(mine)
    except Exception as e:  # noqa: BLE001 - the gathers must still happen on every rank
        mine = f"{type(e).__name__}: {e}"
        encoded = torch.zeros((2, 6), dtype=torch.int64)  # marker rows: one piece in two groups
        encoded[1, 1] = 1
    # Fast path: int64 tables only. Every rank sees the same tables, so all take the slow path or none.
    if not suspicious(comm.all_gather_rows(encoded)):
        return tensors
    table = comm.all_gather(mine)
    failed = [(r, m) for r, m in enumerate(table) if isinstance(m, str)]
    if failed:
        raise ReplicaMismatchError(f"{where}: the replica check failed on rank {failed[0][0]}: {failed[0][1]}")
    bad = mismatches(table)
    if bad:
        fqn, groups = bad[0]
        raise ReplicaMismatchError(_message(where, fqn, groups, [n for n, _ in bad[1:]]), fqn, groups)
    copies = copied_names(table)
    if not copies:
        return tensors
    return [replace(t, fqn=copy_name(t.fqn, t.replica_group)) if t.fqn in copies else t for t in tensors]


class CopyRule(Rule):
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

    def segments(self, phys_len: int) -> list[Segment]:
        return [Segment(0, phys_len, "", 0)]

    def part_names(self) -> list[str]:
        return [""]

    def physical_len(self, logical: Mapping[str, int]) -> int:
        return logical[""]


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
