"""Format version 3 and strict parsing, as pure functions (no processes; files only for open_inside)."""

from __future__ import annotations

import json
import os

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.errors import CorruptCheckpointError, FormatError, UnsafeCheckpointError
from shardpoint.format.index import INDEX_MAGIC, ChunkIndex, encode_index, fqn_key
from shardpoint.format.manifest import ChunkMeta, Manifest, TensorMeta, RankFiles, seal, unseal
from shardpoint.format.strict import Limits, strict_loads
from shardpoint.format.values import check_optimizer_doc, decode_value, encode_value
from shardpoint.geometry import Box
from shardpoint.storage.safe_open import open_inside

H = "0123456789abcdef"


# ---------------------------------------------------------------- strict JSON
@pytest.mark.parametrize(
    "text,match",
    [
        (b'{"a": NaN}', "non-finite number NaN"),
        (b'{"a": -Infinity}', "non-finite number -Infinity"),
        (b'{"a": 1e999}', "outside the float64 range"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": 9223372036854775808}', "outside int64"),
        (b'{"a": -9223372036854775809}', "outside int64"),
        (b'{"a": ' + b"9" * 400 + b"}", "400 digits"),
        (b'{"a": ' + b"1" * 5000 + b"}", "5000 digits"),
        (b'{"a": "\\ud800"}', "lone surrogate"),
        (b'{"\\udfff": 1}', "lone surrogate"),
        (b"[" * 300 + b"]" * 300, "nesting deeper than 256"),
        (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
        (b"\xff{}", "not valid JSON"),
        (b'{"a": 1', "not valid JSON"),
    ],
)
def test_strict_loads_refuses(text, match):
    with pytest.raises(FormatError, match=match) as ei:
        strict_loads(text, "ckpt/x")
    assert str(ei.value).startswith("ckpt/x: ")


def test_strict_loads_accepts_what_writers_write():
    doc = {"a": [1, -(2**63), 2**63 - 1, 0.5, -1e300, "é ✓ 𝄞", None, True], "b": {"c": {}}}
    assert strict_loads(json.dumps(doc).encode(), "x") == doc
    assert strict_loads(json.dumps(doc, ensure_ascii=False).encode(), "x") == doc


def test_string_limit_and_env(monkeypatch):
    with pytest.raises(FormatError, match="string of 11 characters exceeds the limit of 10"):
        strict_loads(b'["' + b"a" * 11 + b'"]', "x", Limits(string_chars=10))
    monkeypatch.setenv("SHARDPOINT_MAX_MANIFEST_BYTES", "1234")
    monkeypatch.setenv("SHARDPOINT_MAX_JSON_DEPTH", "3")
    lim = Limits.from_env()
    assert lim.manifest_bytes == 1234 and lim.depth == 3 and lim.index_bytes == Limits().index_bytes
    with pytest.raises(FormatError, match="nesting deeper than 3"):
        strict_loads(b"[[[[1]]]]", "x")
    monkeypatch.setenv("SHARDPOINT_MAX_JSON_DEPTH", "-2")
    with pytest.raises(ValueError, match="SHARDPOINT_MAX_JSON_DEPTH must be a positive integer"):
        Limits.from_env()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_format_error(data):
    try:
        strict_loads(data, "x")
    except FormatError:
        pass


# ---------------------------------------------------------------- the manifest's digest
def _v3() -> Manifest:
    return Manifest(
        save_id="ab" * 8, world_size=1, block_size=64,
        tensors={"w": TensorMeta("float32", (4,), None, holders=((0, 1),))},
        values={"extra": {"step": 1}}, files={"data/a.bin": 16, "data/a.idx": 100},
        format_version=3, ranks=(RankFiles("data/a.bin", "data/a.idx", "0" * 32),),
    )


def test_seal_round_trip_and_layout():
    data = _v3().to_json()
    head, _, tail = data.rpartition(b',"digest":"')
    assert tail == xxhash.xxh3_128_hexdigest(head).encode() + b'"}' and len(tail) == 34
    assert json.loads(data)["digest"] == xxhash.xxh3_128_hexdigest(head)
    assert unseal(data, "x") is True and unseal(b'{"a":1}', "x") is False
    assert Manifest.from_json(data, "x") == _v3()
    assert seal(data[: data.rindex(b',"digest":')] + b"}") == data


@pytest.mark.parametrize("i", range(0, 400, 7))
def test_any_flipped_bit_of_a_sealed_manifest_is_refused(i):
    data = bytearray(_v3().to_json())
    pos = i % len(data)
    data[pos] ^= 1 << (i % 8)
    with pytest.raises((CorruptCheckpointError, FormatError)):
        Manifest.from_json(bytes(data), "x")


def test_version_3_without_its_digest_is_refused():
    data = _v3().to_json()
    stripped = data[: data.rindex(b',"digest":')] + b"}"
    with pytest.raises(CorruptCheckpointError, match="lacks its digest member"):
        Manifest.from_json(stripped, "ckpt/x")
    with pytest.raises(CorruptCheckpointError, match="does not match its own digest"):
        Manifest.from_json(data.replace(b'"step":1', b'"step":2'), "ckpt/x")


def test_tensor_larger_than_all_files_is_refused_before_allocation():
    doc = json.loads(_v3().to_json())
    doc.pop("digest")
    doc["tensors"]["w"]["shape"] = [2**40]
    with pytest.raises(FormatError, match=r"tensor 'w' of shape \(1099511627776,\).*more than the 116 bytes"):
        Manifest.from_json(seal(json.dumps(doc, separators=(",", ":")).encode()), "ckpt/x")


# ---------------------------------------------------------------- index version 3
def _records():
    return [("a", ChunkMeta(Box((0,), (4,)), "data/a.bin", 0, 16, (H,))), ("b", ChunkMeta(Box((0, 0), (2, 2)), "data/a.bin", 64, 8, (H,)))]


def _parse(data):
    return ChunkIndex.parse(data, file="data/a.bin", file_size=200, rank=0, block=64, where="ckpt/x")


def test_index_v3_binds_the_dtype_and_carries_a_digest():
    data = encode_index(_records(), {"a": "float32", "b": "int16"})
    assert data[:8] == INDEX_MAGIC == b"SPIDX\x00\x03\x00"
    assert xxhash.xxh3_128_digest(data[:-16]) == data[-16:]
    ix = _parse(data)
    assert len(ix.chunks("a", (4,), 4, "t", "float32")) == 1
    assert ix.chunks("a", (4,), 4, "t", "int32") == []  # retyped: no rows
    assert ix.chunks("b", (2, 2), 2, "t", "int16")[0].box == Box((0, 0), (2, 2))
    assert ix.rows_for("a", "float32") == 1 and ix.rows_for("a", "int32") == 0
    assert fqn_key("a", "float32") != fqn_key("a") != fqn_key("a", "int32")
    with pytest.raises(ValueError, match="needs the tensor's dtype"):
        ix.chunks("a", (4,), 4, "t")
    bad = bytearray(data)
    bad[40] ^= 1
    with pytest.raises(FormatError, match="does not match its own digest"):
        _parse(bytes(bad))
    with pytest.raises(FormatError, match="does not match its own digest"):
        _parse(data[:-1])


def test_index_v2_still_reads():
    data = encode_index(_records())
    assert data[:8] == b"SPIDX\x00\x02\x00"
    assert len(_parse(data).chunks("a", (4,), 4, "t")) == 1


# ---------------------------------------------------------------- value documents
def test_big_ints_round_trip_as_tagged_text():
    for v in (2**63, -(2**63) - 1, 3**500, 2**128 + 1):
        doc = encode_value({"v": v}, "x", lambda *a: None)
        assert doc["v"] == {"__sp__": "int", "v": str(v)}
        assert decode_value(strict_loads(json.dumps(doc).encode(), "x"), lambda k: None) == {"v": v}
    assert encode_value(2**63 - 1, "x", lambda *a: None) == 2**63 - 1
    for bad in ("1" * 1002, "12a", "", "--1", "١٢"):
        with pytest.raises(FormatError, match="malformed 'int' value"):
            decode_value({"__sp__": "int", "v": bad}, lambda k: None, where="ckpt/x")


def _opt():
    return {"groups": [{"lr": 0.1}], "group_of": {"w": 0}, "state": {"w": {"step": 1}}}


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: None, "value document is missing or not an object"),
        (lambda d: d.pop("groups"), "lacks its field 'groups'"),
        (lambda d: d.update(groups=5), "field 'groups' must be a list"),
        (lambda d: d.update(groups=[[1]]), r"field 'groups.0' must be an object"),
        (lambda d: d["groups"][0].update(params=[0]), r"'groups.0' must not hold 'params'"),
        (lambda d: d.update(group_of={"w": "0"}), r"field 'group_of.w' must be a group index in \[0, 1\)"),
        (lambda d: d.update(group_of={"w": 1}), r"field 'group_of.w' must be a group index"),
        (lambda d: d.update(group_of={"w": True}), r"field 'group_of.w'"),
        (lambda d: d.update(group_of=[0]), "field 'group_of' must be an object"),
        (lambda d: d.update(state=[]), "field 'state' must be an object"),
        (lambda d: d["state"].update(w=[1]), r"field 'state.w' must be an object"),
    ],
)
def test_optimizer_document_is_validated_field_by_field(edit, match):
    d = _opt()
    doc = None if edit(d) is None and match.startswith("value document") else d
    with pytest.raises(FormatError, match=match) as ei:
        check_optimizer_doc(doc, "ckpt/x: entry 'optim'")
    assert str(ei.value).startswith("ckpt/x: entry 'optim'")


def test_optimizer_document_passes_and_keeps_framework_fields():
    d = {**_opt(), "deepspeed": {"loss_scaler": {}}}
    assert check_optimizer_doc(d, "x") == (d["state"], d["groups"], d["group_of"])


# ---------------------------------------------------------------- opening files
def test_open_inside_refuses_links_fifos_and_folders(tmp_path):
    root = tmp_path / "ck"
    (root / "data").mkdir(parents=True)
    (root / "data" / "ok.bin").write_bytes(b"abc")
    (tmp_path / "outside.bin").write_bytes(b"abc")
    os.symlink(tmp_path / "outside.bin", root / "data" / "link.bin")
    os.mkfifo(root / "data" / "fifo.bin")
    (root / "data" / "dir.bin").mkdir()
    os.symlink(root / "data", root / "alias")
    fd = open_inside(str(root), "data/ok.bin")
    try:
        assert os.pread(fd, 10, 0) == b"abc"
    finally:
        os.close(fd)
    for name, what in [("data/link.bin", "symbolic link"), ("data/fifo.bin", "FIFO"), ("data/dir.bin", "directory"),
                       ("alias/ok.bin", "its folder alias\\) is a symbolic link"), ("../outside.bin", "unsafe file name")]:
        with pytest.raises(UnsafeCheckpointError, match=what) as ei:
            open_inside(str(root), name)
        assert name in str(ei.value)
    with pytest.raises(FileNotFoundError):
        open_inside(str(root), "data/none.bin")
    # The checkpoint folder itself may be reached through a link.
    os.symlink(root, tmp_path / "link_to_ck")
    os.close(open_inside(str(tmp_path / "link_to_ck"), "data/ok.bin"))


def test_a_version_2_index_named_by_a_version_3_manifest_is_refused(tmp_path):
    """A downgrade (the index rewritten without dtype-bound keys, digests recomputed) cannot hide a retype."""
    import torch

    import shardpoint as sp

    path = str(tmp_path / "ck")
    sp.save(path, {"w": torch.arange(6.0)})
    m = sp.read_manifest(path)
    (rank,) = m.ranks
    blob = encode_index([("w", m.tensors["w"].chunks[0])])  # version 2: keys without the dtype
    with open(os.path.join(path, rank.index), "wb") as f:
        f.write(blob)
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    doc = json.loads(raw)
    doc.pop("digest")
    doc["files"][rank.index] = len(blob)
    doc["ranks"][0][2] = xxhash.xxh3_128_hexdigest(blob)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode()))
    with pytest.raises(CorruptCheckpointError, match="has index version 2, which a format-version-3 manifest cannot name"):
        sp.read_tensor(path, "w")
