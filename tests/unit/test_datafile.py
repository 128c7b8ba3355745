"""The data-file layout (format/datafile.py): pure, checked against hand-computed bytes and digests."""

from __future__ import annotations

import io

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.datafile import (
    ALIGN,
    BlockHasher,
    DataFileWriter,
    block_checksums,
    block_count,
    padding,
    verify_blocks,
)
from shardpoint.geometry import Box


def _h(b: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(b)


def test_padding_reaches_the_next_multiple_of_align():
    assert ALIGN == 64
    assert [padding(p) for p in (0, 1, 63, 64, 65, 130)] == [0, 63, 1, 0, 63, 62]


def test_block_count_is_one_for_an_empty_chunk():
    assert [block_count(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def test_block_checksums_are_xxh3_64_of_each_block():
    data = bytes(range(40))
    assert block_checksums(data, 16) == [_h(data[:16]), _h(data[16:32]), _h(data[32:])]
    assert block_checksums(b"", 16) == [_h(b"")]
    assert block_checksums(bytes(32), 16) == [_h(bytes(16))] * 2  # no extra digest after a full last block


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 40), st.lists(st.integers(0, 90), max_size=12))
def test_hashing_in_pieces_equals_hashing_whole(data, block, cuts):
    h = BlockHasher(block)
    pos = 0
    for c in sorted(cuts):
        c = min(c, len(data))
        h.update(data[pos:max(pos, c)])
        pos = max(pos, c)
    h.update(data[pos:])
    whole = [_h(data[i:i + block]) for i in range(0, len(data), block)] or [_h(b"")]
    assert h.digests() == whole == block_checksums(data, block)


def test_writer_aligns_pads_with_zeros_and_records_chunks():
    sink = io.BytesIO()
    w = DataFileWriter(sink, "data/x-r00003.bin", block=16, rank=3)
    a = w.add(b"\x01" * 10, Box((0,), (10,)))
    w.begin()
    w.write(b"\x02" * 5)
    w.write(b"\x03" * 20)
    b = w.end(Box((2, 0), (5, 5)), (0, 25))
    c = w.add(b"", Box((0,), (0,)))
    raw = sink.getvalue()
    # The empty chunk is padded to like any other, so the file ends with that padding.
    assert raw == b"\x01" * 10 + bytes(54) + b"\x02" * 5 + b"\x03" * 20 + bytes(39)
    assert w.pos == len(raw) == 128
    assert (a.file, a.offset, a.nbytes, a.rank, a.flat) == ("data/x-r00003.bin", 0, 10, 3, None)
    assert a.checksums == (_h(b"\x01" * 10),)
    assert (b.offset, b.nbytes, b.flat, b.box) == (64, 25, (0, 25), Box((2, 0), (5, 5)))
    assert b.checksums == (_h(b"\x02" * 5 + b"\x03" * 11), _h(b"\x03" * 9))
    # An empty chunk starts aligned and has the digest of no bytes.
    assert (c.offset, c.nbytes, c.checksums) == (128, 0, (_h(b""),))


def test_writer_refuses_unbalanced_calls():
    w = DataFileWriter(io.BytesIO(), "f", block=16)
    with pytest.raises(RuntimeError, match="f: write outside a chunk"):
        w.write(b"x")
    with pytest.raises(RuntimeError, match="f: end outside a chunk"):
        w.end(Box((0,), (1,)))
    w.begin()
    with pytest.raises(RuntimeError, match="f: a chunk is already open"):
        w.begin()


def test_writer_reports_checksum_and_write_time():
    class Rec:
        def __init__(self):
            self.seen = []

        def add(self, phase, t0, t1, n):
            assert t0 <= t1
            self.seen.append((phase, n))

    rec = Rec()
    DataFileWriter(io.BytesIO(), "f", block=16, recorder=rec).add(b"abc", Box((0,), (3,)))
    assert rec.seen == [("checksum", 3), ("write", 3)]


def test_verify_blocks_names_the_first_bad_block():
    sink = io.BytesIO()
    w = DataFileWriter(sink, "data/f.bin", block=16)
    w.add(b"\x00" * 64, Box((0,), (1,)))  # pushes the next chunk to offset 64
    chunk = w.add(bytes(range(40)), Box((0,), (40,)))
    good = bytearray(sink.getvalue()[64:])
    verify_blocks(memoryview(good), chunk, 0, 16, "t", "ckpt")
    verify_blocks(memoryview(good)[16:], chunk, 1, 16, "t", "ckpt")  # a partial read from block 1
    good[20] ^= 1
    with pytest.raises(CorruptCheckpointError) as e:
        verify_blocks(memoryview(good), chunk, 0, 16, "t", "ckpt")
    assert str(e.value) == (
        "ckpt: checksum mismatch in data/f.bin bytes [80, 96) of tensor 't' (chunk at offsets [0]); "
        "the checkpoint is corrupt"
    )
