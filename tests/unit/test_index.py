"""The per-rank binary chunk index is untrusted input: round trips, and every tampering is a FormatError."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.errors import FormatError
from shardpoint.format import index as index_mod
from shardpoint.format.index import (
    HEADER_SIZE,
    ROW_DTYPE,
    ChunkIndex,
    encode_index,
    fqn_key,
    index_digest,
)
from shardpoint.format.manifest import MAX_ELEMENTS, ChunkMeta
from shardpoint.geometry import Box

# These tests exercise the version-2 layout (encode_index without dtypes); version 3 adds a key
# bound to the dtype and a digest trailer, tested in tests/unit/test_hardening.py.
INDEX_MAGIC = b"SPIDX\x00\x02\x00"
SETTINGS = settings(max_examples=150, deadline=None)
H = "0123456789abcdef"
FILE = "data/aa-r00003.bin"


def nsum(nbytes: int, block: int) -> int:
    return max(1, -(-nbytes // block))


def parse(data: bytes, file_size: int = 1000, block: int = 32) -> ChunkIndex:
    return ChunkIndex.parse(data, file=FILE, file_size=file_size, rank=3, block=block, where="ckpt/x")


def chunk(box: Box, offset: int, itemsize: int = 4, flat=None, block: int = 32, rank: int = 3) -> ChunkMeta:
    numel = box.numel if flat is None else flat[1] - flat[0]
    nbytes = numel * itemsize
    return ChunkMeta(box, FILE, offset, nbytes, (H,) * nsum(nbytes, block), flat, rank)


def sample() -> list[tuple[str, ChunkMeta]]:
    """float32 w (4, 6) in two row chunks, a bf16 flat slice, and an int64 scalar; block 32."""
    return [
        ("model.w", chunk(Box((2, 0), (2, 6)), 0)),
        ("model.w", chunk(Box((0, 0), (2, 6)), 48)),
        ("model.flat", chunk(Box((0, 0), (3, 5)), 96, 2, (0, 7))),
        ("step", chunk(Box((), ()), 112, 8)),
    ]


SHAPES = {"model.w": ((4, 6), 4), "model.flat": ((3, 5), 2), "step": ((), 8)}


# The row layout as the module docstring spells it, so a reader needs numpy only.
DOC_ROW = np.dtype(
    [("key", "<u8"), ("offset", "<u8"), ("nbytes", "<u8"), ("flat_start", "<u8"), ("flat_stop", "<u8"),
     ("nsum", "<u8"), ("ndim", "<u4"), ("flags", "<u4")]
)


def split(data: bytes):
    """Decode with numpy alone, as the module docstring says, into writable copies."""
    assert data[:8] == b"SPIDX\x00\x02\x00"
    n, nd, ns = (int(v) for v in np.frombuffer(data, "<u8", 3, 8))
    rows = np.frombuffer(data, DOC_ROW, n, 32).copy()
    dims = np.frombuffer(data, "<u8", nd, 32 + 56 * n).copy()
    sums = np.frombuffer(data, "<u8", ns, 32 + 56 * n + 8 * nd).copy()
    return rows, dims, sums


def pack(rows, dims, sums, counts=None, magic=INDEX_MAGIC) -> bytes:
    """Re-encode arrays without any checks, so tests can build lying indexes."""
    counts = counts or (len(rows), len(dims), len(sums))
    return magic + struct.pack("<3Q", *counts) + rows.tobytes() + dims.tobytes() + sums.tobytes()


def row(rows, fqn: str) -> int:
    """Index of the first row of ``fqn``."""
    return int(np.flatnonzero(rows["key"] == fqn_key(fqn))[0])


def rejects(data: bytes, match: str, **kw) -> None:
    with pytest.raises(FormatError, match=match):
        parse(data, **kw)


# --- round trips --------------------------------------------------------------


def test_round_trip_sample():
    recs = sample()
    ix = parse(encode_index(recs))
    assert len(ix) == 4
    for fqn, (shape, itemsize) in SHAPES.items():
        got = ix.chunks(fqn, shape, itemsize, f"tensor {fqn!r}")
        want = [c for f, c in recs if f == fqn]
        assert sorted(got, key=repr) == sorted(want, key=repr)
        assert ix.rows_for(fqn) == len(want)
    assert ix.chunks("missing", (4,), 4, "t") == [] and ix.rows_for("missing") == 0
    assert sorted(ix.keys().tolist()) == sorted({fqn_key(f) for f in SHAPES})
    # Rows of one key come sorted by box offsets.
    assert [c.box.offsets for c in ix.chunks("model.w", (4, 6), 4, "t")] == [(0, 0), (2, 0)]


def test_file_and_rank_come_from_the_reader():
    ix = ChunkIndex.parse(encode_index(sample()), file="data/b.bin", file_size=200, rank=7, block=32, where="w")
    (c,) = ix.chunks("step", (), 8, "t")
    assert (c.file, c.rank) == ("data/b.bin", 7)


def test_empty_index():
    data = encode_index([])
    assert len(data) == HEADER_SIZE
    ix = parse(data, file_size=0)
    assert len(ix) == 0 and ix.keys().size == 0 and ix.chunks("a", (1,), 1, "t") == []


def test_layout_matches_docstring():
    assert DOC_ROW == ROW_DTYPE and DOC_ROW.itemsize == 56 and HEADER_SIZE == 32
    data = encode_index(sample())
    rows, dims, sums = split(data)
    assert len(data) == 32 + 56 * len(rows) + 8 * len(dims) + 8 * len(sums)
    assert list(rows["key"]) == sorted(rows["key"])
    assert int(rows["ndim"].sum()) * 2 == len(dims)
    assert int(rows["nsum"].sum()) == len(sums)
    assert format(int(sums[0]), "016x") == H
    (flat_row,) = rows[rows["flags"] == 1]
    assert (flat_row["flat_start"], flat_row["flat_stop"], flat_row["ndim"]) == (0, 7, 2)


@st.composite
def tensors_and_records(draw):
    block = draw(st.sampled_from([16, 64]))
    tensors, records, pos = {}, [], 0
    for t in range(draw(st.integers(0, 5))):
        fqn = f"layers.{t}.{draw(st.sampled_from(['w', 'b', 'exp_avg', 'ü']))}"
        ndim = draw(st.integers(0, 4))
        shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        tensors[fqn] = (shape, itemsize)
        for _ in range(draw(st.integers(0, 4))):
            offs, sizes = [], []
            for n in shape:
                lo = draw(st.integers(0, n))
                hi = draw(st.integers(lo, n))
                offs.append(lo)
                sizes.append(hi - lo)
            box = Box(tuple(offs), tuple(sizes))
            flat = None
            if draw(st.booleans()):
                a = draw(st.integers(0, box.numel))
                flat = (a, draw(st.integers(a, box.numel)))
            numel = box.numel if flat is None else flat[1] - flat[0]
            nbytes = numel * itemsize
            sums = tuple(
                format(draw(st.integers(0, 2**64 - 1)), "016x") for _ in range(nsum(nbytes, block))
            )
            records.append((fqn, ChunkMeta(box, FILE, pos, nbytes, sums, flat, 3)))
            pos += nbytes + draw(st.integers(0, 8))
    records = draw(st.permutations(records))
    return tensors, records, block, pos + draw(st.integers(0, 8))


@SETTINGS
@given(tensors_and_records())
def test_round_trip_random(case):
    tensors, records, block, file_size = case
    ix = parse(encode_index(records), file_size=file_size, block=block)
    assert len(ix) == len(records)
    for fqn, (shape, itemsize) in tensors.items():
        want = sorted((c for f, c in records if f == fqn), key=repr)
        assert sorted(ix.chunks(fqn, shape, itemsize, fqn), key=repr) == want
        assert ix.rows_for(fqn) == len(want)
    assert set(ix.keys().tolist()) == {fqn_key(f) for f, _ in records}


def test_encoding_is_deterministic_whatever_the_record_order():
    recs = sample()
    assert encode_index(recs) == encode_index(recs[::-1])


def test_encode_rejects_records_no_reader_accepts():
    box = Box((0,) * 17, (1,) * 17)
    with pytest.raises(ValueError, match="17 dims"):
        encode_index([("x", ChunkMeta(box, FILE, 0, 4, (H,)))])
    with pytest.raises(ValueError, match="flat range"):
        encode_index([("x", ChunkMeta(Box((0,), (3,)), FILE, 0, 4, (H,), (2, 4)))])
    with pytest.raises(ValueError, match="16-hex-digit"):
        encode_index([("x", ChunkMeta(Box((0,), (3,)), FILE, 0, 12, ("abc",)))])
    with pytest.raises(ValueError, match="lowercase hex"):
        encode_index([("x", ChunkMeta(Box((0,), (3,)), FILE, 0, 12, (H.upper(),)))])


def test_chunks_returns_every_row_of_a_colliding_key(monkeypatch):
    # Collisions are rejected at save time; if one slips through, the box checks still hold.
    monkeypatch.setattr(index_mod, "fqn_key", lambda fqn: 7)
    ix = parse(encode_index(sample()))
    assert ix.rows_for("anything") == 4
    with pytest.raises(FormatError, match="tensor 'step'.* has rank 2"):
        ix.chunks("step", (), 8, "tensor 'step'")


# --- tampering ----------------------------------------------------------------


def test_truncated_or_extended_bytes():
    data = encode_index(sample())
    rejects(data[:-1], "header claims 4 rows")
    rejects(data + b"\0", "but the index is")
    rejects(data[:20], "shorter than the 32-byte header")
    rejects(b"", "shorter than")


def test_bad_magic_and_version():
    data = encode_index(sample())
    rejects(b"PK\x03\x04" + data[4:], "bad magic")
    rejects(data[:6] + (4).to_bytes(2, "little") + data[8:], "index format version 4 is not supported")


def test_lying_counts_do_not_allocate():
    data = encode_index(sample())
    for counts in [(2**60, 0, 0), (4, 2**62, 7), (0, 0, 2**64 - 1), (2**64 - 1,) * 3]:
        bad = data[:8] + struct.pack("<3Q", *counts) + data[32:]
        tracemalloc.start()
        try:
            rejects(bad, "header claims")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


def test_unsorted_keys():
    rows, dims, sums = split(encode_index(sample()))
    rows[[0, 3]] = rows[[3, 0]]  # dims/sums now misattributed too, but the order check comes first
    rejects(pack(rows, dims, sums), r"row 1: key .* out of order")


def test_chunk_bytes_past_end_of_file():
    data = encode_index(sample())
    parse(data, file_size=120)  # step's 8 bytes at 112 end the file exactly
    past = r"row \d: chunk bytes \[112, 120\) run past the end of data/aa-r00003.bin \(119 bytes\)"
    rejects(data, past, file_size=119)
    rows, dims, sums = split(data)
    i = row(rows, "step")
    rows["offset"][i] = 2**64 - 4  # offset + nbytes wraps u64
    rejects(pack(rows, dims, sums), rf"row {i}: chunk bytes \[18446744073709551612, 18446744073709551620\)")
    rows["offset"][i], rows["nbytes"][i] = 0, 2**64 - 1
    rejects(pack(rows, dims, sums), rf"row {i}: chunk bytes", file_size=2**63)


def test_wrong_checksum_count():
    data = encode_index(sample())
    rows, dims, sums = split(data)
    i = row(rows, "step")
    rows["nsum"][i] += 1
    more = np.r_[sums, sums[:1]]
    rejects(pack(rows, dims, more), rf"row {i}: 2 block checksums, expected 1 for 8 bytes in blocks of 32")
    j = row(rows, "model.w")
    rejects(data, rf"row {j}: 2 block checksums, expected 3 for 48 bytes in blocks of 16", block=16)


def test_checksum_range_outside_array():
    rows, dims, sums = split(encode_index(sample()))
    rejects(pack(rows, dims, sums[:-1]), "rows use more or fewer block checksums than the header's 5")
    rejects(pack(rows, dims, np.r_[sums, sums]), "rows use more or fewer block checksums than the header's 12")


def test_checksum_total_cannot_wrap_u64():
    # block 1: nsum == nbytes, and 2**63 + (2**63 + 2) wraps to the header's 2.
    rows = np.zeros(2, ROW_DTYPE)
    rows["key"] = [1, 2]
    rows["nbytes"] = rows["nsum"] = [2**63, 2**63 + 2]
    rows["offset"] = [0, 0]
    data = pack(rows, np.zeros(0, "<u8"), np.zeros(2, "<u8"))
    rejects(data, "more or fewer block checksums", file_size=2**64 - 1, block=1)


def test_dims_range_outside_array():
    rows, dims, sums = split(encode_index(sample()))
    rows["ndim"][rows["ndim"] == 0] = 1
    rejects(pack(rows, dims, sums), "rows use 14 dims but the header says 12")
    rows, dims, sums = split(encode_index(sample()))
    rejects(pack(rows, dims[:-2], sums), "rows use 12 dims but the header says 10")


def test_ndim_and_flags():
    rows, dims, sums = split(encode_index(sample()))
    rows["ndim"][1] = 17
    rejects(pack(rows, dims, sums), "row 1: ndim 17 exceeds 16")
    rows, dims, sums = split(encode_index(sample()))
    rows["flags"][1] = 4
    rejects(pack(rows, dims, sums), "row 1: unknown flags 0x4")


def test_box_values_and_numel():
    rows, dims, sums = split(encode_index(sample()))
    dims[-1] = 2**62 + 1
    rejects(pack(rows, dims, sums), r"row 3: box offset or size 4611686018427387905 exceeds 2\*\*62")
    rows, dims, sums = split(encode_index(sample()))
    dims[-2:] = 2**24 + 1  # last row is model.w (0,0)+(2,6): now (0,0)+(2**24+1)**2
    rejects(pack(rows, dims, sums), f"row 3: box of more than {MAX_ELEMENTS} elements")


def test_flat_range():
    rows, dims, sums = split(encode_index(sample()))
    i = row(rows, "model.flat")
    rows["flat_stop"][i] = 16
    rejects(pack(rows, dims, sums), rf"row {i}: flat range \[0, 16\) outside its box of 15 elements")
    rows["flat_start"][i], rows["flat_stop"][i] = 8, 7
    rejects(pack(rows, dims, sums), r"flat range \[8, 7\)")
    rows, dims, sums = split(encode_index(sample()))
    i = row(rows, "step")
    rows["flat_stop"][i] = 1
    rejects(pack(rows, dims, sums), rf"row {i}: flat range fields set without the flat flag")


def test_rows_checked_against_the_tensor():
    ix = parse(encode_index(sample()))
    with pytest.raises(FormatError, match=r"tensor w: chunk at row \d of the index of data/aa-r00003.bin has rank 2"):
        ix.chunks("model.w", (24,), 4, "tensor w")
    with pytest.raises(FormatError, match=r"\(2, 0\)\+\(2, 6\) lies outside shape \(3, 6\)"):
        ix.chunks("model.w", (3, 6), 4, "tensor w")
    with pytest.raises(FormatError, match="nbytes 48 != 12 elements x 2 bytes"):
        ix.chunks("model.w", (4, 6), 2, "tensor w")
    with pytest.raises(FormatError, match="nbytes 14 != 7 elements x 4 bytes"):
        ix.chunks("model.flat", (3, 5), 4, "tensor flat")


def test_memoryview_input_is_copied():
    buf = bytearray(encode_index(sample()))
    ix = parse(memoryview(buf))
    buf[:] = b"\xff" * len(buf)
    assert len(ix.chunks("model.w", (4, 6), 4, "t")) == 2


def _check_valid(ix: ChunkIndex, tensors, file_size: int, block: int) -> None:
    for fqn, (shape, itemsize) in tensors.items():
        try:
            got = ix.chunks(fqn, shape, itemsize, fqn)
        except FormatError:
            continue
        for c in got:
            assert c.box.within(shape) and c.offset + c.nbytes <= file_size
            assert c.nbytes == c.numel * itemsize
            assert len(c.checksums) == nsum(c.nbytes, block)
            assert all(len(s) == 16 and int(s, 16) >= 0 for s in c.checksums)


SAMPLE_CASE = (SHAPES, sample(), 32, 120)


@st.composite
def mutated(draw):
    """A valid case (the sample or random records) and a mutation of its index bytes."""
    tensors, records, block, file_size = draw(st.just(SAMPLE_CASE) | tensors_and_records())
    data = bytearray(encode_index(records))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "byte", "word", "cut", "insert"]))
        if kind == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif kind == "word" and len(data) >= 8:
            # Whole u64 fields hit counts, offsets and dims with extreme values.
            i = 8 * draw(st.integers(0, len(data) // 8 - 1))
            v = draw(st.sampled_from([0, 1, 2, 16, 17, 2**32, 2**62, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
            data[i : i + 8] = v.to_bytes(8, "little")
        elif kind == "cut" and data:
            i = draw(st.integers(0, len(data)))
            data = data[:i] + data[i + draw(st.integers(1, 16)) :]
        elif kind == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return tensors, bytes(data), block, file_size


@settings(max_examples=300, deadline=None)
@given(mutated())
def test_random_mutations_never_escape(case):
    tensors, data, block, file_size = case
    try:
        ix = parse(data, file_size=file_size, block=block)
    except FormatError:
        return
    _check_valid(ix, tensors, file_size, block)


def test_digest_changes_with_any_byte():
    data = encode_index(sample())
    d = index_digest(data)
    assert len(d) == 32 and d == index_digest(memoryview(data))
    for i in range(len(data)):
        b = bytearray(data)
        b[i] ^= 0x01
        assert index_digest(bytes(b)) != d


# --- speed --------------------------------------------------------------------


def test_encode_and_parse_5000_records_fast():
    recs = []
    for t in range(2500):
        for r in range(2):
            box = Box((r * 512, 0), (512, 1024))
            recs.append((f"model.layers.{t}.weight", ChunkMeta(box, FILE, (2 * t + r) << 21, 1 << 21, (H,) * 8)))
    best = (float("inf"),)
    for _ in range(3):  # best of three: shared CI machines are noisy
        t0 = time.perf_counter()
        data = encode_index(recs)
        t1 = time.perf_counter()
        ix = ChunkIndex.parse(data, file=FILE, file_size=5000 << 21, rank=0, block=1 << 18, where="w")
        t2 = time.perf_counter()
        best = min(best, (t2 - t0, t1 - t0, t2 - t1))
    for t in range(0, 2500, 250):
        assert len(ix.chunks(f"model.layers.{t}.weight", (1024, 1024), 4, "t")) == 2
    print(f"5000 records: encode {1e3 * best[1]:.1f} ms, parse {1e3 * best[2]:.1f} ms, {len(data)} bytes")
    assert best[0] < 0.5
