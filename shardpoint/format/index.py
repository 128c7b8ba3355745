"""Per-rank binary chunk index (format version 2).

Format version 1 lists every chunk record in the JSON manifest. Version 2
moves them into one small binary index per rank, written next to that rank's
data file (``data/<save_id>-rNNNNN.bin`` gets ``data/<save_id>-rNNNNN.idx``).
The manifest records each index file's size and :func:`index_digest`, so a
loader checks the digest before parsing; :meth:`ChunkIndex.parse` still treats
the bytes as untrusted. A bad index raises ``FormatError``: parsing never reads
out of bounds, allocates more than O(len(data)) memory, or runs code.

All records of one index belong to one data file and one writer rank, so
neither is stored: the reader supplies both from the manifest.

Tensors are found by :func:`fqn_key`, a 64-bit hash of the fully qualified
name. Two different names with the same key in one checkpoint must be rejected
at save time by the caller; :meth:`ChunkIndex.chunks` returns every row with
the key and checks each against the tensor asked for.

Byte layout (integers little-endian, no padding; every array starts 8-aligned)::

    offset  size  field
    0       8     magic  b"SPIDX\\x00\\x02\\x00"  (bytes 6-7: index version, u16 = 2)
    8       8     nrows  u64  number of rows
    16      8     ndims  u64  length of the dims array (sum of 2*ndim over rows)
    24      8     nsums  u64  length of the checksum array (sum of nsum over rows)
    32      56*nrows        rows, ROW_DTYPE below
    ...     8*ndims         dims: u64
    ...     8*nsums         checksums: u64

    (index version 3 only) 16  digest: xxh3_128 of every byte before it, big-endian

    The file is exactly 32 + 56*nrows + 8*ndims + 8*nsums bytes (version 2),
    plus 16 for the digest (version 3).

    ROW_DTYPE (56 bytes):
    0   key         u64  fqn_key: xxh3_64 of the UTF-8 name (version 2), or of
                         the name, a NUL byte and the dtype name (version 3)
    8   offset      u64  byte offset of the chunk in the data file
    16  nbytes      u64  stored byte count
    24  flat_start  u64  flat range start (0 without the flat flag)
    32  flat_stop   u64  flat range stop (0 without the flat flag)
    40  nsum        u64  block checksums = max(1, ceil(nbytes / block_size))
    48  ndim        u32  box rank, at most 16
    52  flags       u32  bit 0: the flat range is set; other bits 0

Rows are sorted by key; the writer breaks ties by box offsets, box sizes,
flat flag, flat range and byte offset, so its output is deterministic.
Each row's dims are ``ndim`` box offsets then ``ndim`` box sizes, and its
checksums are ``nsum`` xxh3_64 digests; both arrays are in row order, so row
i's slices start at the running sums over rows before it. A checksum is the
integer value of the 16-hex-digit digest (``format(v, "016x")`` restores it).
Reading it with numpy alone::

    n, nd, ns = (int(v) for v in np.frombuffer(data, "<u8", 3, 8))
    rows = np.frombuffer(data, ROW_DTYPE, n, 32)
    dims = np.frombuffer(data, "<u8", nd, 32 + 56 * n)
    sums = np.frombuffer(data, "<u8", ns, 32 + 56 * n + 8 * nd)
"""

from __future__ import annotations

import re
import struct
from typing import Mapping, Sequence

import numpy as np
import xxhash

from ..errors import FormatError
from ..geometry import Box
from .manifest import MAX_ELEMENTS, MAX_NDIM, ChunkMeta

__all__ = [
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "ROW_DTYPE",
    "HEADER_SIZE",
    "TRAILER_SIZE",
    "READ_INDEX_VERSIONS",
    "fqn_key",
    "index_digest",
    "encode_index",
    "ChunkIndex",
]

# Index layout version, stored in bytes 6-7 of the magic (matches the manifest format version).
INDEX_VERSION = 3
READ_INDEX_VERSIONS = (2, 3)
# First 8 bytes of every index file this version writes.
INDEX_MAGIC = b"SPIDX\x00" + INDEX_VERSION.to_bytes(2, "little")
_MAGIC_PREFIX = INDEX_MAGIC[:6]
# Version 3 ends with the xxh3_128 digest of everything before it.
TRAILER_SIZE = 16
# Magic plus the three u64 counts (nrows, ndims, nsums).
HEADER_SIZE = 32
# One row per chunk; see the module docstring for the field meanings.
ROW_DTYPE = np.dtype(
    [
        ("key", "<u8"),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("flat_start", "<u8"),
        ("flat_stop", "<u8"),
        ("nsum", "<u8"),
        ("ndim", "<u4"),
        ("flags", "<u4"),
    ]
)
assert ROW_DTYPE.itemsize == 56
_FLAT = 1
# Same bound as the manifest's _int: box offsets and sizes stay far from u64 overflow.
_MAX_DIM = 1 << 62
_HEX = re.compile(r"[0-9a-f]*")
_U64 = np.uint64


def fqn_key(fqn: str, dtype: str | None = None) -> int:
    """The 64-bit lookup key of a tensor's chunks in an index.

    Version 2 (``dtype=None``): xxh3_64 of the UTF-8 name. Version 3: xxh3_64
    of the name, a NUL byte and the dtype name, so the rows are bound to what
    the manifest says the tensor is: renaming or retyping a manifest entry
    leaves it with no chunks, and the load fails instead of reinterpreting bytes.

    Example::

        fqn_key("model.w", "float32") != fqn_key("model.w", "int32")   # True
    """
    raw = fqn.encode("utf-8") if dtype is None else fqn.encode("utf-8") + b"\0" + dtype.encode("ascii")
    return xxhash.xxh3_64_intdigest(raw)


def index_digest(data: bytes | memoryview) -> str:
    """The digest the manifest records for an index file: xxh3_128, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def encode_index(records: Sequence[tuple[str, ChunkMeta]], dtypes: Mapping[str, str] | None = None) -> bytes:
    """Encode ``(fqn, chunk)`` records of one rank's one data file as index bytes.

    With ``dtypes`` (each record's tensor's dtype name) the index is version
    3: keys bind name and dtype, and a digest trailer follows. Without it,
    version 2 (kept for tests of older checkpoints).
    ``ChunkMeta.file`` and ``.rank`` are not stored (the reader supplies them).
    Raises ``ValueError`` on records no reader would accept: more than
    ``MAX_NDIM`` dims, a flat range outside its box, or malformed checksums.
    """
    items = []
    for fqn, c in records:
        box = c.box
        if box.ndim > MAX_NDIM:
            raise ValueError(f"{fqn!r}: chunk box has {box.ndim} dims, the index allows {MAX_NDIM}")
        if c.flat is None:
            flat, flags = (0, 0), 0
        else:
            flat, flags = c.flat, _FLAT
            if not 0 <= flat[0] <= flat[1] <= box.numel:
                raise ValueError(f"{fqn!r}: flat range {flat} outside its box of {box.numel} elements")
        # Sort fields first; the input position breaks ties so ChunkMeta is never compared.
        key = fqn_key(fqn) if dtypes is None else fqn_key(fqn, dtypes[fqn])
        items.append((key, box.offsets, box.sizes, flags, flat, c.offset, len(items), c))
    items.sort(key=lambda t: t[:7])

    rows, dims, sums = [], [], []
    for key, offs, sizes, flags, flat, offset, _, c in items:
        rows.append((key, offset, c.nbytes, flat[0], flat[1], len(c.checksums), len(offs), flags))
        dims += offs
        dims += sizes
        sums += c.checksums
    if sums and not (min(map(len, sums)) == max(map(len, sums)) == 16):
        raise ValueError("block checksums must be 16-hex-digit strings")
    joined = "".join(sums)
    if not _HEX.fullmatch(joined):
        raise ValueError("block checksums must be lowercase hex digits")
    row_arr = np.array(rows, dtype=ROW_DTYPE)
    dim_arr = np.array(dims, dtype="<u8")
    # A hex digest is the big-endian spelling of the integer.
    sum_arr = np.frombuffer(bytes.fromhex(joined), dtype=">u8").astype("<u8")
    header = struct.pack("<3Q", len(rows), len(dims), len(sums))
    if dtypes is None:
        return b"SPIDX\x00\x02\x00" + header + row_arr.tobytes() + dim_arr.tobytes() + sum_arr.tobytes()
    body = INDEX_MAGIC + header + row_arr.tobytes() + dim_arr.tobytes() + sum_arr.tobytes()
    return body + xxhash.xxh3_128_digest(body)



def _bad(mask: np.ndarray, pre: str, msg) -> None:
    """Raise a FormatError for the first row where ``mask`` holds, worded by ``msg(row)``."""
    if mask.any():
        i = int(np.flatnonzero(mask)[0])
        raise FormatError(f"{pre}: row {i}: {msg(i)}")


def _header(data: bytes, pre: str) -> tuple[bytes, int, int, int, int]:
    """Check the magic, version, digest and counts; return the body without its trailer, version and counts."""
    if len(data) < HEADER_SIZE:
        raise FormatError(f"{pre}: {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic = data[:8]
    if magic[:6] != _MAGIC_PREFIX:
        raise FormatError(f"{pre}: bad magic {magic!r}, not a shardpoint chunk index")
    version = int.from_bytes(magic[6:], "little")
    if version not in READ_INDEX_VERSIONS:
        raise FormatError(f"{pre}: index format version {version} is not supported (reads versions 2 and 3)")
    if version >= 3:
        if len(data) < HEADER_SIZE + TRAILER_SIZE or xxhash.xxh3_128_digest(data[:-TRAILER_SIZE]) != data[-TRAILER_SIZE:]:
            raise FormatError(f"{pre}: the index does not match its own digest; the file is damaged")
        data = data[:-TRAILER_SIZE]
    # Python ints: a lying count cannot overflow the size check or allocate.
    n, nd, ns = (int.from_bytes(data[i : i + 8], "little") for i in (8, 16, 24))
    want = HEADER_SIZE + ROW_DTYPE.itemsize * n + 8 * nd + 8 * ns
    if want != len(data):
        raise FormatError(
            f"{pre}: header claims {n} rows, {nd} dims and {ns} checksums ({want} bytes) "
            f"but the index is {len(data)} bytes"
        )
    return data, version, n, nd, ns


def _check_layout(rows: np.ndarray, nd: int, pre: str) -> tuple[np.ndarray, np.ndarray]:
    """Keys sorted, ndim bounded, flags known, dims used as the header says; return each row's dims end and ndim."""
    keys = rows["key"]
    unsorted = np.r_[False, keys[1:] < keys[:-1]]
    _bad(unsorted, pre, lambda i: f"key {keys[i]:#x} is out of order (rows must be sorted by key)")
    ndim, flags = rows["ndim"], rows["flags"]
    _bad(ndim > MAX_NDIM, pre, lambda i: f"ndim {ndim[i]} exceeds {MAX_NDIM}")
    _bad(flags & ~np.uint32(_FLAT) != 0, pre, lambda i: f"unknown flags {int(flags[i]):#x}")
    ndim64 = ndim.astype(np.int64)
    dend = np.cumsum(2 * ndim64)  # ndim <= 16: cannot overflow int64
    used = int(dend[-1]) if len(rows) else 0
    if used != nd:
        raise FormatError(f"{pre}: rows use {used} dims but the header says {nd}")
    return dend, ndim64


def _check_bytes(rows: np.ndarray, ns: int, pre: str, file: str, file_size: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk inside the file, with one checksum per block; return the running checksum ends and counts."""
    off, nb = rows["offset"], rows["nbytes"]
    fs = _U64(file_size)
    _bad(
        (nb > fs) | (off > fs - np.minimum(nb, fs)), pre,
        lambda i: f"chunk bytes [{off[i]}, {int(off[i]) + int(nb[i])}) run past the end of {file} ({file_size} bytes)",
    )
    blk = _U64(block)
    expect = np.maximum(nb // blk + (nb % blk != 0).astype(_U64), _U64(1))
    nsum = rows["nsum"]
    _bad(
        nsum != expect, pre,
        lambda i: f"{nsum[i]} block checksums, expected {expect[i]} for {nb[i]} bytes in blocks of {block}",
    )
    send = np.cumsum(nsum, dtype=_U64)
    # A u64 wrap leaves a running sum below its own last term.
    wrapped = bool((send < nsum).any())
    if wrapped or (int(send[-1]) if len(rows) else 0) != ns:
        raise FormatError(f"{pre}: rows use more or fewer block checksums than the header's {ns}")
    return send, nsum


def _check_boxes(rows: np.ndarray, dims: np.ndarray, dend: np.ndarray, ndim64: np.ndarray, pre: str) -> np.ndarray:
    """Box values and sizes bounded, flat ranges inside their box; return each row's first dim."""
    n = len(rows)
    bad_dim = dims > _U64(_MAX_DIM)
    if bad_dim.any():
        j = int(np.flatnonzero(bad_dim)[0])
        i = int(np.searchsorted(dend, j, "right"))
        raise FormatError(f"{pre}: row {i}: box offset or size {dims[j]} exceeds 2**62")
    # Box numels, one pass per dim position. float64 is exact up to 2**53 > MAX_ELEMENTS,
    # and a product of 16 sizes <= 2**62 stays finite, so the bound check below is exact.
    dstart = dend - 2 * ndim64
    numel_f = np.ones(n)
    for d in range(int(ndim64.max()) if n else 0):
        has = ndim64 > d
        numel_f[has] *= dims[dstart[has] + ndim64[has] + d]
    _bad(numel_f > MAX_ELEMENTS, pre, lambda i: f"box of more than {MAX_ELEMENTS} elements")
    numel = numel_f.astype(_U64)
    flags = rows["flags"]
    fa, fb = rows["flat_start"], rows["flat_stop"]
    has_flat = (flags & np.uint32(_FLAT)) != 0
    _bad(~has_flat & ((fa != 0) | (fb != 0)), pre, lambda i: "flat range fields set without the flat flag")
    _bad(
        has_flat & ((fa > fb) | (fb > numel)), pre,
        lambda i: f"flat range [{fa[i]}, {fb[i]}) outside its box of {numel[i]} elements",
    )
    return dstart

class ChunkIndex:
    """A parsed, validated chunk index of one data file.

    Build with :meth:`parse`. Lookups by tensor name are a binary search over
    the sorted keys. ``file`` and ``rank`` are the data file and writer rank
    the reader supplied; they go into every returned ``ChunkMeta``.
    """

    __slots__ = ("file", "rank", "version", "_rows", "_keys", "_dims", "_sums", "_dstart", "_sstart", "_spans", "_lists")

    def __init__(self, *args, **kwargs):  # pragma: no cover - guard only
        raise TypeError("build a ChunkIndex with ChunkIndex.parse")

    @staticmethod
    def parse(
        data: bytes | memoryview, *, file: str, file_size: int, rank: int, block: int, where: str
    ) -> "ChunkIndex":
        """Parse and validate untrusted index bytes of data file ``file``.

        ``file_size`` is the data file's size and ``block`` the checksum block
        size, both from the (already validated) manifest. Checks, vectorised and
        O(rows): magic and version, header counts against ``len(data)``
        exactly, keys sorted, ``ndim <= MAX_NDIM``, known flags, every chunk's
        bytes inside ``file_size``, ``nsum == max(1, ceil(nbytes / block))``,
        dims and checksum totals, box values at most 2**62, box numel at most
        ``MAX_ELEMENTS``, and flat ranges inside their box. Checks against the
        tensor (rank, shape, dtype size) happen in :meth:`chunks`.
        """
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        if not isinstance(file_size, int) or not 0 <= file_size < 1 << 64:
            raise ValueError(f"file_size must be an int in [0, 2**64), got {file_size!r}")
        # A private immutable copy: the arrays below are views into it.
        data = data if isinstance(data, bytes) else bytes(data)
        pre = f"{where}: index of {file}"
        data, version, n, nd, ns = _header(data, pre)
        rows = np.frombuffer(data, ROW_DTYPE, n, HEADER_SIZE)
        dims = np.frombuffer(data, "<u8", nd, HEADER_SIZE + ROW_DTYPE.itemsize * n)
        sums = np.frombuffer(data, "<u8", ns, HEADER_SIZE + ROW_DTYPE.itemsize * n + 8 * nd)
        keys = rows["key"]
        dend, ndim64 = _check_layout(rows, nd, pre)
        send, nsum = _check_bytes(rows, ns, pre, file, file_size, block)
        dstart = _check_boxes(rows, dims, dend, ndim64, pre)

        self = object.__new__(ChunkIndex)
        self.file, self.rank, self.version = file, rank, version
        self._rows, self._keys, self._dims, self._sums = rows, keys, dims, sums
        self._dstart = dstart
        self._sstart = (send - nsum).astype(np.int64)  # <= ns, fits
        # Each key's rows [lo, hi), found once: a load asks for every tensor it needs.
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if n else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], n] if n else starts
        self._spans = dict(zip(keys[starts].tolist(), zip(starts.tolist(), ends.tolist())))
        self._lists = None
        return self

    def __len__(self) -> int:
        """Number of rows (chunks) in the index."""
        return len(self._rows)

    def keys(self) -> np.ndarray:
        """The distinct fqn keys present, as a sorted read-only ``uint64`` array."""
        k = self._keys
        out = k[np.r_[True, k[1:] != k[:-1]]] if len(k) else k.copy()
        out.flags.writeable = False
        return out

    def _span(self, fqn: str, dtype: str | None) -> tuple[int, int]:
        if self.version >= 3:
            if dtype is None:
                raise ValueError("a version-3 index needs the tensor's dtype to find its rows")
            return self._spans.get(fqn_key(fqn, dtype), (0, 0))
        return self._spans.get(fqn_key(fqn), (0, 0))

    def rows_for(self, fqn: str, dtype: str | None = None) -> int:
        """Number of rows of tensor ``fqn`` (its ``dtype`` is needed for version 3; O(1))."""
        lo, hi = self._span(fqn, dtype)
        return hi - lo

    def chunks(self, fqn: str, shape: Sequence[int], itemsize: int, what: str, dtype: str | None = None) -> list[ChunkMeta]:
        """All chunks of tensor ``fqn`` (global ``shape``, dtype ``dtype`` of ``itemsize`` bytes) here.

        ``dtype`` is part of the key in a version-3 index (required there).

        Returns an empty list when the index has none. Each row is checked
        against the tensor: box rank equals ``len(shape)``, the box lies inside
        ``shape``, and ``nbytes`` equals its element count times ``itemsize``;
        otherwise ``FormatError(f"{what}: ...")``. O(log rows + rows returned).
        """
        lo, hi = self._span(fqn, dtype)
        out: list[ChunkMeta] = []
        if lo == hi:
            return out
        if self._lists is None:  # Python lists of the arrays, made once: per-row numpy access is slow
            self._lists = (self._rows.tolist(), self._dstart.tolist(), self._sstart.tolist(), self._dims.tolist())
        rows, dstart, sstart, dims = self._lists
        for i in range(lo, hi):
            _, offset, nbytes, fa, fb, nsum, ndim, flags = rows[i]
            ds, ss = dstart[i], sstart[i]
            if ndim != len(shape):
                raise FormatError(f"{self._where(what, i)} has rank {ndim}, the tensor has shape {tuple(shape)}")
            d = dims[ds : ds + 2 * ndim]
            box = Box(tuple(d[:ndim]), tuple(d[ndim:]))
            if not box.within(shape):
                raise FormatError(f"{self._where(what, i)}: {box.offsets}+{box.sizes} lies outside shape {tuple(shape)}")
            flat = (fa, fb) if flags & _FLAT else None
            numel = box.numel if flat is None else fb - fa
            if nbytes != numel * itemsize:
                raise FormatError(f"{self._where(what, i)}: nbytes {nbytes} != {numel} elements x {itemsize} bytes")
            hx = self._sums[ss : ss + nsum].astype(">u8").tobytes().hex()
            sums = tuple(hx[k : k + 16] for k in range(0, len(hx), 16))
            out.append(ChunkMeta(box, self.file, offset, nbytes, sums, flat, self.rank))
        return out

    def _where(self, what: str, i: int) -> str:
        return f"{what}: chunk at row {i} of the index of {self.file}"
