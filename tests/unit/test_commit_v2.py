"""The version-2 commit on rank 0, fed by hand-made statuses and descriptions (no processes)."""

from __future__ import annotations

import pytest

from shardpoint.engine.commit import CommitTarget, commit_save
from shardpoint.errors import CorruptCheckpointError, ShapeMismatchError, UnsupportedStateError
from shardpoint.format.manifest import Manifest, RankFiles
from shardpoint.planning.commit import Documents
from shardpoint.planning.describe import GridEntry, ListedEntry, Mesh, RankStatus, TensorsDoc, ValuesDoc
from shardpoint.storage.memory import MemoryStorage


def _doc(meshes=(), **tensors) -> TensorsDoc:
    return TensorsDoc(tuple(Mesh(tuple(s), tuple(r)) for s, r in meshes), tensors)


def _grid(shape, placement, mesh, splits, copy):
    return GridEntry("float32", tuple(shape), placement, mesh, tuple(tuple(x) for x in splits), copy)


def _listed(shape, placement, wrote):
    return ListedEntry("float32", tuple(shape), placement, wrote)


def _values(values=None, frameworks=None) -> ValuesDoc:
    return ValuesDoc(values or {}, frameworks or {})


GRID_DOC = _doc([((4,), (0, 1, 2, 3))], w=_grid([8, 2], "dtensor", 0, [[0], []], 0))
NONE = Documents()


def _status(r, tdig="t", vdig="v", cover=None, wrote=True):
    files = {f"data/x-r{r:05d}.bin": 64, f"data/x-r{r:05d}.idx": 32} if wrote else {}
    index = RankFiles(f"data/x-r{r:05d}.bin", f"data/x-r{r:05d}.idx", "0" * 32) if wrote else None
    return RankStatus(files, index, tdig, vdig, cover or {})


def _commit_of(statuses, docs):
    store = MemoryStorage()
    docs = [d if isinstance(d, Documents) else Documents(*d) for d in docs]
    commit_save(CommitTarget(store, "ab" * 8, 1 << 20, "ck"), len(statuses), statuses, docs)
    return Manifest.from_json(store.get("manifest.json"), "ck")


def test_one_descriptor_per_digest_makes_a_grid_manifest():
    statuses = [_status(r) for r in range(4)]
    docs = [(GRID_DOC, _values({"extra": {"step": 1}}, {"extra": "values"}))] + [NONE] * 3
    m = _commit_of(statuses, docs)
    t = m.tensors["w"]
    assert t.grid.ranks == (0, 1, 2, 3) and t.grid.splits == ((0,), ()) and t.copy == 0 and t.chunks is None
    assert m.values == {"extra": {"step": 1}} and m.format_version == 3
    assert [r.index for r in m.ranks] == [f"data/x-r{r:05d}.idx" for r in range(4)]
    assert len(m.files) == 8


def test_a_grid_not_every_mesh_rank_holds_is_refused():
    # Pipeline stages without replicated_over: rank 1 holds other layers, not "w".
    statuses = [_status(0, "a"), _status(1, "b")]
    other = _doc()
    doc = _doc([((2,), (0, 1))], w=_grid([4], "replicated", 0, [[]], 1))
    with pytest.raises(CorruptCheckpointError, match=r"'w' is held by 1 rank\(s\), but its layout spans 2.*replicated_over"):
        _commit_of(statuses, [(doc, _values()), (other, None)])


def test_ranks_describing_differently_are_refused():
    a = _doc([((2,), (0, 1))], w=_grid([4], "dtensor", 0, [[0]], 0))
    b = _doc(w=_listed([4], "dtensor", True))
    with pytest.raises(CorruptCheckpointError, match=r"ranks describe tensor 'w' with 2 different layouts"):
        _commit_of([_status(0, "a"), _status(1, "b")], [(a, _values()), (b, None)])
    # Per-rank tensors under one name, each declared held by its own rank only.
    own = [_doc([((1,), (r,))], t=_grid([3], "local", 0, [[]], 0)) for r in (0, 1)]
    with pytest.raises(CorruptCheckpointError, match=r"'t' with 2 different layouts.*different data under one name"):
        _commit_of([_status(0, "a"), _status(1, "b")], [(own[0], _values()), (own[1], None)])


def test_listed_tensors_need_exact_coverage():
    doc = _doc(f=_listed([10], "fsdp1", True))
    ok = [_status(0, cover={"f": 6}), _status(1, cover={"f": 4})]
    m = _commit_of(ok, [(doc, _values()), NONE])
    assert m.tensors["f"].holders == ((0, 2),)
    short = [_status(0, cover={"f": 6}), _status(1, cover={"f": 3})]
    with pytest.raises(CorruptCheckpointError, match=r"saved chunks of 'f' cover 9 of 10 elements"):
        _commit_of(short, [(doc, _values()), NONE])


def test_only_writers_are_holders_of_a_listed_tensor():
    wrote = _doc(f=_listed([4], "fsdp1", True))
    idle = _doc(f=_listed([4], "fsdp1", False))
    st = [_status(0, "w", cover={"f": 4}), _status(1, "i", wrote=False), _status(2, "i", wrote=False)]
    m = _commit_of(st, [(wrote, _values()), (idle, None), NONE])
    assert m.tensors["f"].holders == ((0, 1),) and m.ranks[1] is None


def test_shape_disagreement_names_both():
    a = _doc(f=_listed([4], "x", True))
    b = _doc(f=_listed([5], "x", True))
    with pytest.raises(ShapeMismatchError, match=r"ranks disagree on tensor 'f': \('float32', \(4,\)\) vs \('float32', \(5,\)\)"):
        _commit_of([_status(0, "a"), _status(1, "b")], [(a, _values()), (b, None)])


def test_values_merge_over_distinct_documents_lower_rank_wins():
    doc = _doc()
    v0 = _values({"extra": {"a": 1, "b": 2}}, {"extra": "values"})
    v2 = _values({"extra": {"b": 9, "c": 3}, "rng": {"r": 2}}, {"rng": "stateful"})
    st = [_status(0, vdig="x"), _status(1, vdig="x"), _status(2, vdig="y")]
    m = _commit_of(st, [(doc, v0), NONE, (None, v2)])
    assert m.values == {"extra": {"a": 1, "b": 2, "c": 3}, "rng": {"r": 2}}
    assert m.layout["entries"] == {"extra": "values", "rng": "stateful"}


def test_colliding_keys_are_refused(monkeypatch):
    import shardpoint.planning.commit as planning_commit

    monkeypatch.setattr(planning_commit, "fqn_key", lambda name, dtype=None: 7)
    doc = _doc(a=_listed([0], "x", False), b=_listed([0], "x", False))
    with pytest.raises(UnsupportedStateError, match=r"tensor names 'a' and 'b' share a 64-bit key"):
        _commit_of([_status(0)], [(doc, _values())])


def _fake_comm(rank, world):
    from shardpoint.dist import Comm

    c = Comm.__new__(Comm)
    c.group, c.active, c.rank, c.world = None, False, rank, world
    return c


def test_small_replicated_tensors_are_written_by_copy_zero_and_described_by_one_grid():
    import torch

    from shardpoint.saving.options import SaveOptions
    from shardpoint.saving.prepare import describe_on, prepare_save
    from shardpoint.saving.result import SaveResult

    state = {"extra": {"step": torch.tensor(3.0), "norm": torch.ones(64), "big": torch.ones(4096), "big2": torch.ones(4096)}}
    mine, digests = {}, set()
    for r in range(4):
        comm = _fake_comm(r, 4)
        plan = prepare_save(state, comm, SaveOptions(), SaveResult("ck", "x"))
        mine[r] = sorted(t.fqn for t in plan.mine)
        d = describe_on(plan, comm)
        digests.add(d.digest)
        assert not d.listed and d.doc.meshes == (Mesh((4,), (0, 1, 2, 3)),)
        assert all(isinstance(e, GridEntry) for e in d.doc.tensors.values())
        copies = {k: e.copy for k, e in d.doc.tensors.items()}
    # 4 bytes and 256 bytes: copy 0; the two 16 KiB tensors are balanced over copies 0 and 1.
    assert copies["extra.step"] == copies["extra.norm"] == 0
    assert sorted([copies["extra.big"], copies["extra.big2"]]) == [0, 1]
    assert {"extra.step", "extra.norm"} <= set(mine[0]) and mine[2] == mine[3] == []
    assert len(digests) == 1  # every rank describes the state identically
