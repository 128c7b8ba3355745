"""Format version 2: grids and holders instead of chunk lists, chunks resolved from per-rank indexes.

No processes: manifests and index files are built by hand on a MemoryStorage,
as four ranks of a (dp=2, tp=2) mesh would write them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import shardpoint as sp
from shardpoint.engine.indexes import IndexReader, resolve, resolve_all, wanted_box
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import encode_index, index_digest
from shardpoint.format.manifest import ChunkMeta, Manifest, RankFiles, TensorMeta, rank_runs
from shardpoint.geometry import Box
from shardpoint.geometry.grid import Grid
from shardpoint.storage.memory import MemoryStorage

H = "0123456789abcdef"
SHAPE = (8, 6)
# dim 0 split by tp (mesh dim 1), then dp (mesh dim 0): FSDP2 over a column-parallel weight.
GRID = Grid((2, 2), (0, 1, 2, 3), ((1, 0), ()))


def _build(tamper=None):
    """Four ranks' index files and the manifest describing them."""
    store = MemoryStorage()
    ranks, files = [], {}
    for r in range(4):
        coord = GRID.coord_of(r)
        box = GRID.box(SHAPE, coord)
        data, index = f"data/ab-r{r:05d}.bin", f"data/ab-r{r:05d}.idx"
        records = [("w", ChunkMeta(box, data, 0, box.numel * 4, (H,), None, r))]
        if r == 3:  # rank 3 also holds a piece of a listed tensor
            records.append(("flat", ChunkMeta(Box((0,), (10,)), data, 64, 40, (H,), None, r)))
        blob = encode_index(records)
        if tamper is not None:
            blob = tamper(r, blob)
        store.put_atomic(index, blob)
        files[data], files[index] = 128, len(blob)
        ranks.append(RankFiles(data, index, index_digest(blob)))
    ranks.append(None)  # rank 4 wrote nothing
    m = Manifest(
        save_id="ab" * 8,
        world_size=5,
        block_size=1 << 20,
        tensors={
            "w": TensorMeta("float32", SHAPE, None, GRID, 0),
            "flat": TensorMeta("float32", (10,), None, holders=((3, 5),)),
        },
        values={"extra": {"step": 3}},
        files=files,
        created=1.5,
        format_version=2,
        ranks=tuple(ranks),
    )
    store.put_atomic("manifest.json", m.to_json())
    return store, m


def test_round_trip_is_exact_and_small():
    _, m = _build()
    data = m.to_json()
    back = Manifest.from_json(data, "ck")
    assert back == m and back.to_json() == data
    doc = json.loads(data)
    assert "chunks" not in json.dumps(doc["tensors"])
    assert doc["meshes"] == [{"shape": [2, 2], "ranks": [0, 1, 2, 3]}]
    assert doc["tensors"]["w"]["grid"] == {"mesh": 0, "splits": [[1, 0], []], "copy": 0}
    assert doc["tensors"]["flat"]["holders"] == [[3, 5]]
    assert not back.resolved


def test_rank_runs():
    assert rank_runs([5, 0, 1, 2, 2]) == ((0, 3), (5, 6))
    assert rank_runs([]) == ()


def test_resolving_a_box_reads_only_the_writers_indexes():
    store, m = _build()
    reader = IndexReader(store, Manifest.from_json(store.get("manifest.json"), "ck"), "ck")
    # Rows 4..6 lie in tp=1's half, dp=0's quarter: (tp 1, dp 0) is mesh coord (0, 1) = rank 1.
    got = reader.chunks("w", [Box((4, 0), (2, 6))])
    assert [(c.rank, c.box) for c in got] == [(1, Box((4, 0), (2, 6)))]
    assert set(reader._cache) == {1}
    assert got[0].file == "data/ab-r00001.bin" and got[0].checksums == (H,)
    every = reader.chunks("w")
    assert sorted((c.rank, c.box.offsets) for c in every) == [(0, (0, 0)), (1, (4, 0)), (2, (2, 0)), (3, (6, 0))]
    assert [c.box for c in reader.chunks("flat")] == [Box((0,), (10,))]


def test_resolve_fills_only_wanted_tensors_and_all_fills_every_one():
    store, m = _build()
    part = resolve(store, m, {"w": [Box((0, 0), (1, 6))]}, "ck")
    assert [c.rank for c in part.tensors["w"].chunks] == [0]
    assert part.tensors["flat"].chunks is None
    full = resolve_all(store, m, "ck")
    assert full.resolved and len(full.tensors["w"].chunks) == 4
    assert sum(c.numel for c in full.tensors["w"].chunks) == 48


def test_wanted_box_of_a_flat_range_is_its_rows():
    assert wanted_box(Box((0, 0), (8, 6)), (7, 20)) == Box((1, 0), (3, 6))
    assert wanted_box(Box((0, 0), (8, 6)), None) == Box((0, 0), (8, 6))
    assert wanted_box(Box((2,), (8,)), (3, 5)) == Box((5,), (2,))


def test_tampered_index_is_corrupt():
    store, m = _build()
    good = store.get("data/ab-r00002.idx")
    store.put_atomic("data/ab-r00002.idx", good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=r"index file data/ab-r00002.idx of rank 2 does not match the manifest"):
        IndexReader(store, m, "ck").chunks("w")
    store.delete("data/ab-r00002.idx")
    with pytest.raises(CorruptCheckpointError, match=r"index file data/ab-r00002.idx of rank 2 is missing"):
        IndexReader(store, m, "ck").chunks("w")


def test_index_disagreeing_with_the_grid_is_corrupt():
    # Rank 1 claims rows 0..2 instead of 4..6: the digest matches (it wrote that), the grid does not.
    def wrong(r, blob):
        if r != 1:
            return blob
        return encode_index([("w", ChunkMeta(Box((0, 0), (2, 6)), "data/ab-r00001.bin", 0, 48, (H,), None, 1))])

    store, m = _build(wrong)
    with pytest.raises(CorruptCheckpointError, match=r"rank 1's index has no chunk at offsets \[4, 0\] sizes \[2, 6\]"):
        IndexReader(store, m, "ck").chunks("w", [Box((4, 0), (1, 6))])


def _doc():
    return json.loads(_build()[1].to_json())


CASES = {
    "ranks length": (lambda d: d["ranks"].pop(), r"'ranks' must list one entry per rank \(5\)"),
    "rank entry": (lambda d: d["ranks"].__setitem__(0, ["data/ab-r00000.bin"]), r"rank 0's entry must be \[data file, index file, digest\]"),
    "rank digest": (lambda d: d["ranks"][1].__setitem__(2, "xyz"), r"rank 1's index digest 'xyz' is malformed"),
    "rank unlisted": (lambda d: d["ranks"][1].__setitem__(1, "data/zz.idx"), r"rank 1 names unlisted file 'data/zz.idx'"),
    "rank dotdot": (lambda d: d["ranks"][1].__setitem__(1, "../x.idx"), r"unsafe or malformed data file name"),
    "mesh index": (lambda d: d["tensors"]["w"]["grid"].update(mesh=3), r"tensor 'w': grid mesh must be an integer in \[0, 0\]"),
    "splits length": (lambda d: d["tensors"]["w"]["grid"].update(splits=[[1, 0]]), r"grid splits must list one entry per dimension \(2\)"),
    "mesh dim twice": (lambda d: d["tensors"]["w"]["grid"].update(splits=[[1, 0], [0]]), r"mesh dim 0 splits more than once"),
    "copy range": (lambda d: d["tensors"]["w"]["grid"].update(copy=1), r"grid copy must be an integer in \[0, 0\]"),
    "mesh rank range": (lambda d: d["meshes"][0].update(ranks=[0, 1, 2, 9]), r"rank 9 outside \[0, 5\)"),
    "mesh too big": (lambda d: d["meshes"][0].update(shape=[10**9, 2]), r"more coordinates than the 5 ranks"),
    "mesh rank twice": (lambda d: d["meshes"][0].update(ranks=[0, 1, 1, 3]), r"rank 1 appears twice"),
    "holders unsorted": (lambda d: d["tensors"]["flat"].update(holders=[[3, 4], [1, 2]]), r"holders start must be an integer in \[4, 4\]"),
    "holders range": (lambda d: d["tensors"]["flat"].update(holders=[[3, 9]]), r"holders stop must be an integer in \[4, 5\]"),
    "holders empty run": (lambda d: d["tensors"]["flat"].update(holders=[[3, 3]]), r"holders stop must be an integer in \[4, 5\]"),
    "no grid no holders": (lambda d: d["tensors"]["flat"].pop("holders"), r"malformed manifest \(KeyError: 'holders'\)"),
    "meshes not list": (lambda d: d.update(meshes={}), r"'meshes' must be a list"),
    "version as bool": (lambda d: d.update(format_version=True), r"format_version True is not supported"),
}

# Run by test_manifest.py's tampering test, beside the version-1 cases.


def test_saved_checkpoint_is_v2_and_index_tampering_is_caught(tmp_path):
    path = str(tmp_path / "ck")
    w = torch.arange(12.0).reshape(3, 4)
    sp.save(path, {"w": w, "extra": {"step": 1}})
    m = sp.read_manifest(path, chunks=False)
    assert m.format_version == 3 and m.tensors["w"].grid is not None and m.tensors["w"].chunks is None
    assert sp.read_manifest(path).tensors["w"].chunks[0].box == Box((0, 0), (3, 4))
    assert torch.equal(sp.read_tensor(path, "w"), w)
    (idx,) = [f for f in m.files if f.endswith(".idx")]
    with open(os.path.join(path, idx), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=rf"index file {idx} of rank 0 does not match the manifest"):
        sp.load(path, {"w": None, "extra": None})


def test_v2_manifest_needs_resolving_before_v1_serialisation():
    _, m = _build()
    with pytest.raises(ValueError, match="chunks are not resolved"):
        dataclasses.replace(m, format_version=1).to_json()


def test_tensors_on_one_grid_share_shard_lookups_but_not_chunks():
    """The grid's shard lookup is memoised per (grid, shape, copy, box); chunks stay per tensor."""
    store = MemoryStorage()
    ranks, files = [], {}
    for r in range(4):
        box = GRID.box(SHAPE, GRID.coord_of(r))
        data, index = f"data/cd-r{r:05d}.bin", f"data/cd-r{r:05d}.idx"
        n = box.numel * 4
        blob = encode_index([("a", ChunkMeta(box, data, 0, n, (H,), None, r)), ("b", ChunkMeta(box, data, n, n, (H,), None, r))])
        store.put_atomic(index, blob)
        files[data], files[index] = 2 * n, len(blob)
        ranks.append(RankFiles(data, index, index_digest(blob)))
    m = Manifest(save_id="cd" * 8, world_size=4, block_size=1 << 20, files=files, values={}, format_version=2, ranks=tuple(ranks),
                 tensors={k: TensorMeta("float32", SHAPE, None, GRID, 0) for k in ("a", "b")})
    reader = IndexReader(store, m, "ck")
    want = [Box((0, 0), (8, 3))]  # every shard
    a, b = reader.chunks("a", want), reader.chunks("b", want)
    assert len(reader._grid_cache) == 1  # the second tensor reused the first one's lookup
    assert [(c.rank, c.box, c.offset) for c in a] == [(c.rank, c.box, 0) for c in a]
    assert [(c.rank, c.box, c.offset) for c in b] == [(c.rank, c.box, c.numel * 4) for c in a]
    assert sorted(c.rank for c in b) == [0, 1, 2, 3]
