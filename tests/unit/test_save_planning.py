"""Property tests of the save planners: writer choice, rank descriptions and manifest assembly.

No processes: every rank of a layout is built in memory, described, and
committed on paper (milliseconds per example).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.items import SaveTensor
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.manifest import Manifest, RankFiles, rank_runs
from shardpoint.geometry import Box, even_chunks
from shardpoint.geometry.grid import Grid
from shardpoint.planning.commit import Documents, assemble_manifest, representatives
from shardpoint.planning.describe import CandidateGrids, GridEntry, ListedEntry, RankStatus, cover_of, describe, values_doc
from shardpoint.planning.writers import SMALL_REPLICA_BYTES, choose_writers, plan_signature

F32 = torch.empty(0, dtype=torch.float32)  # the planners read only dtype and element size
WORLD = 8


def _replicated(fqn: str, numel: int, copy: int, copies: int, group: str = "", offset: int = 0) -> SaveTensor:
    box = Box((offset,), (numel,))
    return SaveTensor(fqn, F32, (offset + numel,), box, None, copy, copies, float(numel * 4), "replicated", group)


# ----------------------------------------------------------------------------- choose_writers
sizes = st.lists(st.integers(0, 5000), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 6), sizes), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_every_replicated_chunk_has_one_writer_balanced_and_deterministic(groups, seed):
    # Replica group g is held by ranks 0..copies-1, rank r being copy r; a rank lists the tensors of every group it is in.
    rng = random.Random(seed)
    agreed: dict[str, int] = {}
    written: dict[str, int] = {}
    loads: dict[tuple[int, int], float] = {}
    for r in range(max(c for c, _ in groups)):
        tensors = [
            _replicated(f"g{g}.t{i}", n, r, copies, group=f"g{g}")
            for g, (copies, numels) in enumerate(groups) if r < copies for i, n in enumerate(numels)
        ]
        choice = choose_writers(tensors)
        assert choose_writers(list(tensors)) == choice  # deterministic
        shuffled = tensors[:]
        rng.shuffle(shuffled)
        assert choose_writers(shuffled).writers == choice.writers  # independent of the state's order
        for k, w in choice.writers.items():
            assert agreed.setdefault(k, w) == w  # every rank of a group computes the same assignment
        for i in choice.picked:
            t = tensors[i]
            written[t.fqn] = written.get(t.fqn, 0) + 1
            if t.nbytes > SMALL_REPLICA_BYTES:
                key = (int(t.replica_group[1:]), r)
                loads[key] = loads.get(key, 0.0) + t.cost
    for g, (copies, numels) in enumerate(groups):
        for i, n in enumerate(numels):
            fqn = f"g{g}.t{i}"
            assert written.get(fqn) == 1, fqn  # exactly one copy writes each tensor
            if copies > 1 and n * 4 <= SMALL_REPLICA_BYTES:
                assert agreed[fqn] == 0  # small tensors: copy 0, so loaders need few index files
        big = [n * 4.0 for n in numels if n * 4 > SMALL_REPLICA_BYTES]
        if copies > 1 and big:
            per_copy = [loads.get((g, c), 0.0) for c in range(copies)]
            assert max(per_copy) - min(per_copy) <= max(big)  # greedy least-loaded: within one item of even


def test_pieces_of_one_name_are_keyed_by_offset_and_the_signature_tracks_geometry():
    a = [_replicated("w", 2000, r, 2, offset=0) for r in range(2)]
    b = [_replicated("w", 2000, r, 2, offset=2000) for r in range(2)]
    choices = [choose_writers([a[r], b[r]]) for r in range(2)]
    assert set(choices[0].writers) == {"w@(0,)", "w@(2000,)"}
    assert sorted(choices[0].writers.values()) == [0, 1]  # the two 8 KB pieces go to different copies
    assert [len(c.picked) for c in choices] == [1, 1]
    assert choices[1].copy_of(b[1]) == choices[0].writers["w@(2000,)"]
    moved = _replicated("w", 2000, 0, 2, offset=1000)
    assert plan_signature([a[0], b[0]]) == plan_signature([a[0], b[0]])
    assert plan_signature([a[0], b[0]]) != plan_signature([a[0], moved])


# ----------------------------------------------------------------------------- describe -> commit
MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)]


@st.composite
def layouts(draw):
    """Tensors of an 8-rank world: DTensor-like grids on a 1-D to 3-D mesh, plain replicated ones, flat ranges."""
    mesh = draw(st.sampled_from(MESHES))
    ranks = tuple(draw(st.permutations(range(WORLD))))
    specs = []
    for i in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=2)))
        dims = list(range(len(mesh)))
        draw(st.randoms()).shuffle(dims)
        splits: list[list[int]] = [[] for _ in shape]
        for m in dims[: draw(st.integers(0, len(mesh)))]:
            splits[draw(st.integers(0, len(shape) - 1))].append(m)
        specs.append(("grid", f"model.g{i}", shape, Grid(mesh, ranks, tuple(tuple(s) for s in splits))))
    for i in range(draw(st.integers(0, 3))):
        specs.append(("plain", f"extra.p{i}", tuple(draw(st.lists(st.integers(1, 600), max_size=2))), None))
    for i in range(draw(st.integers(0, 2))):
        specs.append(("flat", f"model.f{i}", (draw(st.integers(1, 40)),), None))
    return specs


def _rank_tensors(specs, rank: int) -> list[SaveTensor]:
    out = []
    for kind, fqn, shape, grid in specs:
        cost = float(math.prod(shape) * 4)
        if kind == "grid":
            coord = grid.coord_of(rank)
            out.append(SaveTensor(fqn, F32, shape, grid.box(shape, coord), None, grid.replica_index(coord), grid.copies, cost, "dtensor", "", grid))
        elif kind == "plain":
            out.append(SaveTensor(fqn, F32, shape, Box.full(shape), None, rank, WORLD, cost, "replicated"))
        else:
            lo, n = list(even_chunks(shape[0], WORLD))[rank]
            if n:
                out.append(SaveTensor(fqn, F32, shape, Box.full(shape), (lo, lo + n), 0, 1, cost, "fsdp1"))
    return out


def _save_on_paper(specs):
    tensors, mine, reports = {}, {}, []
    for r in range(WORLD):
        ts = _rank_tensors(specs, r)
        choice = choose_writers(ts)
        tensors[r], mine[r] = ts, [ts[i] for i in choice.picked]
        d = describe(ts, mine[r], choice, r, CandidateGrids(WORLD, lambda fqn: None))
        vdoc, vdig = values_doc({"extra": {"step": 3}} if r == 0 else {}, {"extra": "values"} if r == 0 else {})
        files, index = {}, None
        if mine[r]:
            files = {f"data/s-r{r:05d}.bin": sum(t.nbytes for t in mine[r]), f"data/s-r{r:05d}.idx": 32}
            index = RankFiles(f"data/s-r{r:05d}.bin", f"data/s-r{r:05d}.idx", "0" * 32)
        reports.append((RankStatus(files, index, d.digest, vdig, cover_of(mine[r], d.listed)), d, vdoc))
    return tensors, mine, reports


@settings(max_examples=80, deadline=None)
@given(specs=layouts())
def test_describe_then_commit_round_trips_into_a_manifest(specs):
    tensors, mine, reports = _save_on_paper(specs)
    statuses = [s for s, _, _ in reports]
    ask = representatives(statuses)
    assert len(ask.tensors) == len({s.tensors_digest for s in statuses}) and 0 in ask.tensors
    docs = [Documents(d.doc if r in ask.tensors else None, v if r in ask.values else None) for r, (_, d, v) in enumerate(reports)]
    m = Manifest.from_json(assemble_manifest("ab" * 8, WORLD, 1 << 20, statuses, docs, "t", 1.0).to_json(), "t")
    assert m.format_version == 3 and m.world_size == WORLD and m.values == {"extra": {"step": 3}}
    assert [e is not None for e in m.ranks] == [bool(mine[r]) for r in range(WORLD)]
    for kind, fqn, shape, grid in specs:
        meta = m.tensors[fqn]
        assert (meta.dtype, meta.shape) == ("float32", shape)
        # Every element is written by exactly one rank.
        count = np.zeros(shape if kind != "flat" else (shape[0],), dtype=np.int64)
        for r in range(WORLD):
            for t in mine[r]:
                if t.fqn != fqn:
                    continue
                if t.flat is not None:
                    count[t.flat[0]:t.flat[1]] += 1
                else:
                    count[tuple(slice(o, o + n) for o, n in zip(t.box.offsets, t.box.sizes))] += 1
        assert (count == 1).all(), fqn
        if kind == "flat":
            assert meta.grid is None and meta.holders == rank_runs(r for r in range(WORLD) if any(t.fqn == fqn for t in mine[r]))
            continue
        # Grid tensors (plain ones on the world's replica grid) keep their grid and the copy every rank chose.
        want = grid if kind == "grid" else Grid((WORLD,), tuple(range(WORLD)), ((),) * len(shape))
        assert meta.grid == want and meta.holders is None
        assert {choose_writers(tensors[r]).copy_of(next(t for t in tensors[r] if t.fqn == fqn)) for r in range(WORLD)} == {meta.copy}


@settings(max_examples=40, deadline=None)
@given(specs=layouts())
def test_descriptions_are_typed_and_equal_ranks_share_a_digest(specs):
    _, _, reports = _save_on_paper(specs)
    for status, d, _ in reports:
        for fqn, e in d.doc.tensors.items():
            assert isinstance(e, (GridEntry, ListedEntry))
            assert (fqn in d.listed) == isinstance(e, ListedEntry)
            if isinstance(e, GridEntry):
                assert 0 <= e.mesh < len(d.doc.meshes) and 0 <= e.copy
        assert status.tensors_digest == d.digest == d.doc.digest()
    by_digest: dict[str, object] = {}
    for _, d, _ in reports:
        assert by_digest.setdefault(d.digest, d.doc) == d.doc  # equal digests, equal descriptions


def test_a_tensor_only_some_mesh_ranks_describe_is_refused():
    specs = [("grid", "model.w", (8,), Grid((8,), tuple(range(8)), ((0,),)))]
    _, _, reports = _save_on_paper(specs)
    statuses = [s for s, _, _ in reports]
    docs = [Documents(d.doc, v) for _, d, v in reports]
    statuses[5] = RankStatus(statuses[5].files, statuses[5].index, "other", statuses[5].values_digest, {})
    docs[5] = Documents(type(docs[5].tensors)((), {}), None)  # rank 5 says it holds nothing
    with pytest.raises(CorruptCheckpointError, match=r"'model.w' is held by 7 rank\(s\), but its layout spans 8"):
        assemble_manifest("ab" * 8, WORLD, 1 << 20, statuses, docs, "t", 1.0)
