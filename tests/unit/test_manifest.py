"""The manifest is untrusted input: round trips, and every tampering is a FormatError."""

from __future__ import annotations

import copy
import json

import pytest

from shardpoint.errors import FormatError
from shardpoint.format import FORMAT_VERSION, ChunkMeta, Manifest, TensorMeta, check_file_name
from shardpoint.geometry import Box

from .test_manifest_v2 import CASES as V2_CASES
from .test_manifest_v2 import _doc as v2_doc

H = "0123456789abcdef"  # a well-formed xxh3_64 hex digest


def make_manifest() -> Manifest:
    f0, f1 = "data/aa-r00000.bin", "data/aa-r00001.bin"
    w = TensorMeta(
        "float32",
        (4, 6),
        (
            ChunkMeta(Box((0, 0), (2, 6)), f0, 0, 48, (H, H), None, 0),
            ChunkMeta(Box((2, 0), (2, 6)), f1, 0, 48, (H, H), None, 1),
        ),
    )
    flat = TensorMeta(
        "bfloat16",
        (3, 5),
        (
            ChunkMeta(Box((0, 0), (3, 5)), f0, 64, 14, (H,), (0, 7), 0),
            ChunkMeta(Box((0, 0), (3, 5)), f1, 64, 16, (H,), (7, 15), 1),
        ),
    )
    scalar = TensorMeta("int64", (), (ChunkMeta(Box((), ()), f0, 128, 8, (H,), None, 0),))
    return Manifest(
        save_id="deadbeef" * 4,
        world_size=2,
        block_size=32,
        tensors={"model.w": w, "model.flat": flat, "step": scalar},
        values={"extra": {"lr": 0.5, "name": "run", "t": {"__sp__": "tensor", "key": "step"}}},
        files={f0: 136, f1: 80},
        layout={"world_size": 2},
        created=1234.5,
    )


def doc() -> dict:
    return json.loads(make_manifest().to_json())


def parse(d) -> Manifest:
    return Manifest.from_json(json.dumps(d).encode(), "ckpt/x")


def test_round_trip_is_exact():
    m = make_manifest()
    data = m.to_json()
    back = Manifest.from_json(data, "ckpt/x")
    assert back == m
    assert back.to_json() == data
    assert back.tensors["model.flat"].chunks[1].flat == (7, 15)
    assert back.tensors["step"].chunks[0].box == Box((), ())
    assert back.format_version == 1 and FORMAT_VERSION == 3
    assert back.total_bytes == 96 + 30 + 8


def test_to_json_is_canonical():
    data = make_manifest().to_json()
    d = json.loads(data)
    assert d["format"] == "shardpoint" and d["format_version"] == 1
    assert list(d["tensors"]) == sorted(d["tensors"])
    assert b" " not in data  # compact separators


def test_non_finite_values_cannot_be_written():
    import dataclasses

    m = dataclasses.replace(make_manifest(), values={"x": float("nan")})
    with pytest.raises(ValueError):
        m.to_json()


def _chunk(d, fqn="model.w", i=0):
    return d["tensors"][fqn]["chunks"][i]


CASES = {
    # name: (mutator, message regex)
    "dotdot file": (lambda d: d["files"].update({"../etc/passwd": 10}), r"unsafe or malformed data file name.*\.\./etc/passwd"),
    "dotdot inside": (lambda d: d["files"].update({"data/../../x": 10}), r"unsafe or malformed data file name"),
    "absolute file": (lambda d: d["files"].update({"/etc/passwd": 10}), r"unsafe or malformed data file name.*'/etc/passwd'"),
    "chunk dotdot": (lambda d: _chunk(d).update(file="../data/aa-r00000.bin"), r"tensor 'model.w': unsafe or malformed data file name"),
    "unlisted file": (lambda d: _chunk(d).update(file="data/other.bin"), r"chunk refers to unlisted file 'data/other.bin'"),
    "past file size": (lambda d: d["files"].update({"data/aa-r00001.bin": 60}), r"tensor 'model.flat': chunk bytes \[64, 80\) run past the end of data/aa-r00001.bin"),
    "offset past file": (lambda d: _chunk(d, i=1).update(offset=40), r"chunk bytes \[40, 88\) run past the end"),
    "box outside shape": (lambda d: _chunk(d, i=1).update(offsets=[3, 0]), r"'model.w'.*chunk \(3, 0\)\+\(2, 6\) lies outside shape \(4, 6\)"),
    "box rank": (lambda d: _chunk(d).update(offsets=[0], sizes=[2]), r"chunk rank differs from shape"),
    "negative offset": (lambda d: _chunk(d).update(offsets=[-1, 0]), r"chunk offset must be an integer"),
    "nbytes mismatch": (lambda d: _chunk(d).update(nbytes=44), r"chunk nbytes 44 != 12 elements x 4 bytes"),
    "flat nbytes mismatch": (lambda d: _chunk(d, "model.flat").update(nbytes=16), r"'model.flat'.*chunk nbytes 16 != 7 elements x 2 bytes"),
    "flat outside box": (lambda d: _chunk(d, "model.flat", 1).update(flat=[7, 16]), r"flat range \[7, 16\) outside its box of 15 elements"),
    "flat reversed": (lambda d: _chunk(d, "model.flat", 1).update(flat=[9, 7]), r"flat range \[9, 7\) outside"),
    "flat malformed": (lambda d: _chunk(d, "model.flat", 1).update(flat=[7]), r"malformed flat range"),
    "too many checksums": (lambda d: _chunk(d).update(checksums=[H, H, H]), r"expected 2 block checksums, got 3"),
    "too few checksums": (lambda d: _chunk(d).update(checksums=[H]), r"expected 2 block checksums, got 1"),
    "bad checksum": (lambda d: _chunk(d).update(checksums=["zz" * 8, H]), r"malformed checksum 'zzzzzzzzzzzzzzzz'"),
    "unknown dtype": (lambda d: d["tensors"]["model.w"].update(dtype="float128"), r"'model.w': unknown dtype 'float128'"),
    "huge shape": (
        lambda d: d["tensors"]["model.w"].update(shape=[1 << 25, 1 << 25]),
        r"shape \(33554432, 33554432\) exceeds 281474976710656 elements",
    ),
    "too many dims": (lambda d: d["tensors"]["model.w"].update(shape=[1] * 17), r"shape must be a list of at most 16 ints"),
    "negative dim": (lambda d: d["tensors"]["model.w"].update(shape=[-4, 6]), r"shape must be an integer"),
    "bool as int": (lambda d: _chunk(d).update(offset=False), r"chunk byte offset must be an integer.*got False"),
    "format version": (lambda d: d.update(format_version=5), r"format_version 5 is not supported.*reads versions 1, 2, 3, 4.*upgrade"),
    "format version missing": (lambda d: d.pop("format_version"), r"format_version None is not supported"),
    "not shardpoint": (lambda d: d.update(format="other"), r"not a shardpoint manifest"),
    "checksum algo": (lambda d: d.update(checksum_algorithm="md5"), r"unknown checksum algorithm 'md5'"),
    "block size": (lambda d: d.update(block_size=40), r"block_size 40 is not a multiple of 16"),
    "world size": (lambda d: d.update(world_size=0), r"world_size must be an integer in \[1,"),
    "writer rank": (lambda d: _chunk(d).update(rank=2), r"writer rank must be an integer in \[0, 1\]"),
    "save id": (lambda d: d.update(save_id="../x"), r"malformed save_id"),
    "missing key": (lambda d: d.pop("tensors"), r"malformed manifest \(KeyError: 'tensors'\)"),
    "tensors not object": (lambda d: d.update(tensors=[]), r"'tensors' must be an object"),
    "values not object": (lambda d: d.update(values=[1]), r"'values' and 'layout' must be objects"),
    "chunk not object": (lambda d: d["tensors"]["model.w"].update(chunks=[1]), r"malformed manifest \(TypeError"),
    "file size negative": (lambda d: d["files"].update({"data/aa-r00000.bin": -1}), r"size of data/aa-r00000.bin must be an integer"),
}


@pytest.mark.parametrize("name", list(CASES) + [f"v2: {n}" for n in V2_CASES])
def test_tampering_is_a_format_error(name):
    if name.startswith("v2: "):
        (mutate, pattern), d = V2_CASES[name[4:]], v2_doc()
    else:
        (mutate, pattern), d = CASES[name], doc()
    mutate(d)
    with pytest.raises(FormatError, match=pattern) as ei:
        parse(d)
    assert str(ei.value).startswith("ckpt/x"), "errors name the checkpoint"


def test_untampered_doc_parses():
    # guards the table above: every case fails only because of its own mutation
    assert parse(copy.deepcopy(doc())) == make_manifest()


@pytest.mark.parametrize(
    "data,pattern",
    [
        (b"\x80\x81 not json", r"ckpt/x: manifest is not valid JSON"),
        (b"{\"format\": ", r"manifest is not valid JSON"),
        (b"[1, 2]", r"not a shardpoint manifest"),
        (b"[" * 100_000 + b"]" * 100_000, r"manifest is not valid JSON"),
        (b"", r"manifest is not valid JSON"),
    ],
    ids=["binary", "truncated", "list", "deep", "empty"],
)
def test_not_a_manifest(data, pattern):
    with pytest.raises(FormatError, match=pattern):
        Manifest.from_json(data, "ckpt/x")


def test_deeply_nested_values_parse_but_fail_to_decode():
    """Moderate nesting is valid JSON; the value codec refuses it with a FormatError."""
    from shardpoint.format import decode_value

    d = doc()
    deep = 1
    for _ in range(200):
        deep = [deep]
    d["values"]["extra"]["deep"] = deep
    m = parse(d)
    with pytest.raises(FormatError, match=r"ckpt/x: value nests deeper than 64 levels"):
        decode_value(m.values["extra"], lambda k: None, where="ckpt/x")


@pytest.mark.parametrize(
    "name,ok",
    [
        ("data/abc-r00000.bin", True),
        ("manifest.json", True),
        ("a/b/c/d.bin", True),
        ("a/b/c/d/e.bin", False),  # too deep
        ("../x", False),
        ("data/../x", False),
        ("./x", False),
        ("/abs", False),
        ("", False),
        ("data//x", False),
        ("data/x y", False),
        ("C:\\x", False),
        (".hidden", False),
        ("x" * 129, False),
    ],
)
def test_check_file_name(name, ok):
    if ok:
        assert check_file_name(name) == name
    else:
        with pytest.raises(FormatError, match="unsafe or malformed data file name"):
            check_file_name(name)
