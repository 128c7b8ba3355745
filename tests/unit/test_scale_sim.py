"""Process-free checks of bench/scale_sim.py on a tiny model: the simulated geometry and grids are torch's,
every simulated save is a valid format-version-2 checkpoint whose chunks are exactly the records the ranks
wrote, and loads planned through the indexes read exactly what format version 1 would have read."""

from __future__ import annotations

import itertools
import math
import pickle
import random

import pytest

from bench import scale_sim as S
from shardpoint.engine.indexes import resolve_all
from shardpoint.planning.reads import plan_chunk_reads
from shardpoint.format.manifest import Manifest, TensorMeta
from shardpoint.planning.commit import Documents

TINY = S.ModelSpec(layers=4, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=40, vocab=50)
SPECS = S.state_tensors(TINY)
BLOCK = 64  # several checksum blocks per chunk


@pytest.mark.parametrize("tp,dp", [(1, 4), (1, 7), (2, 3), (2, 8), (4, 8)])
@pytest.mark.parametrize("shape,style", [((52, 16), "col"), ((12, 6), "col"), ((16, 40), "row"), ((16,), "rep"), ((7, 5), "row")])
def test_shard_box_and_grid_are_torchs(shape, style, tp, dp):
    # Column-parallel dims divide by tp here, as in the 70B model: otherwise torch's
    # _StridedShard rows are not one contiguous box (and FSDP2's local shape differs).
    lay = S.Layout(tp, 2, dp)
    grid = S.stage_grid(lay, 1, style, len(shape))
    assert grid == S.torch_grid(lay, 1, style, len(shape))  # grid_of_placements on real placements
    assert grid.ranks == tuple(range(dp * tp, 2 * dp * tp))  # stage 1's ranks
    boxes = []
    for d, t in itertools.product(range(dp), range(tp)):
        want = S.torch_shard_box(shape, style, lay, d, t)
        assert S.shard_box(shape, style, lay, d, t) == want
        got = grid.box(shape, (d, t) if tp > 1 else (d,))
        assert got == want or got.numel == want.numel == 0
        boxes.append(want)
    distinct = {b for b in boxes if b.numel}  # the distinct boxes tile the tensor exactly once
    assert sum(b.numel for b in distinct) == math.prod(shape)
    assert grid.copies == (tp if style == "rep" and tp > 1 else 1)


@pytest.mark.parametrize("lay,mode", [(S.Layout(2, 2, 3), "pp-aware"), (S.Layout(2, 2, 3), "adapters"), (S.Layout(1, 1, 5), "pp-aware")])
def test_closed_form_tensors_are_the_adapters(lay, mode):
    for rank in range(lay.world):
        exact = S.rank_tensors(SPECS, TINY, lay, rank, mode, exact=True)
        fast = S.rank_tensors(SPECS, TINY, lay, rank, mode)
        assert S.same_tensors(exact, fast)
        # DTensors get a grid unless copies lie outside their mesh (other stages, without replicated_over)
        assert all((t.grid is not None) == (mode == "pp-aware" or lay.pp == 1) for t in fast if t.shape)


def _v1_manifest(saved: S.Saved, lay: S.Layout) -> Manifest:
    """Format version 1 of the same save: every written record listed in the manifest."""
    files = {k: v for st in saved.statuses for k, v in st.files.items()}
    tensors = {s.fqn: TensorMeta(S.DTYPE, s.shape, tuple(saved.records.get(s.fqn, ()))) for s in SPECS}
    return Manifest(S.SAVE_ID, lay.world, BLOCK, tensors, {}, files, format_version=1)


def _save(lay: S.Layout) -> tuple[S.Saved, Manifest]:
    saved = S.save_all(SPECS, TINY, lay, BLOCK, check={s.fqn for s in SPECS})
    S.commit(saved, lay, BLOCK, where="t")
    return saved, Manifest.from_json(saved.storage.get(S.MANIFEST_NAME))


@pytest.mark.parametrize("lay", [S.Layout(2, 2, 3), S.Layout(1, 1, 6), S.Layout(2, 4, 2), S.Layout(4, 1, 1)])
def test_every_tensor_written_once_and_commit_round_trips(lay):
    saved, man = _save(lay)
    assert saved.written == {s.fqn: math.prod(s.shape) for s in SPECS}
    assert man.format_version == 3 and len(man.ranks) == lay.world and man.world_size == lay.world
    assert set(man.tensors) == {s.fqn for s in SPECS}
    assert all(t.grid is not None and t.chunks is None for t in man.tensors.values())
    for s in SPECS:  # the writer index recorded for replicated tensors is the one the ranks chose
        t = man.tensors[s.fqn]
        assert t.grid.copies == (lay.tp if s.style == "rep" and lay.tp > 1 else lay.dp * lay.tp if s.style == "scalar" else 1)
    # one descriptor per pipeline stage, and statuses that do not grow with the tensors a rank holds
    assert saved.tdigs == lay.pp and sum(d.tensors is not None for d in saved.docs) == lay.pp
    assert max(map(len, saved.status_blobs)) < 1000
    # every chunk resolved from the indexes equals the record its rank wrote, field by field
    full = resolve_all(saved.storage, man, "t")
    n = 0
    for s in SPECS:
        got = sorted(full.tensors[s.fqn].chunks, key=S._chunk_key)
        want = sorted((c for c in saved.records[s.fqn] if c.numel or not s.shape), key=S._chunk_key)
        assert got == want and got
        n += len(got)
    assert n == saved.chunks - sum(1 for v in saved.records.values() for c in v if c.numel == 0 and c.box.ndim)
    # the index bytes on storage are what the statuses and the manifest say
    for r, e in enumerate(man.ranks):
        assert e is not None and len(saved.storage.get(e.index)) == man.files[e.index] == saved.statuses[r].files[e.index]


def _reads(reads, targets) -> list:
    out = []
    for r in reads:
        jobs = sorted((targets[j.target].fqn, targets[j.target].box.offsets, tuple(sorted((op.region.offsets, op.region.sizes) for op in j.ops))) for j in r.jobs)
        out.append((r.fqn, r.chunk, r.lo, r.hi, r.segments, tuple(jobs)))
    return sorted(out, key=repr)


@pytest.mark.parametrize("src,tgt", [(S.Layout(2, 2, 3), S.Layout(1, 1, 5)), (S.Layout(1, 1, 5), S.Layout(2, 2, 3)),
                                     (S.Layout(4, 1, 2), S.Layout(2, 4, 1)), (S.Layout(2, 2, 3), S.Layout(2, 2, 3))])
def test_v2_load_plans_equal_v1(src, tgt):
    saved, man = _save(src)
    v1 = _v1_manifest(saved, src)
    for rank in range(tgt.world):  # every target rank: the same spans, byte offsets and copies
        targets = S.load_targets(SPECS, TINY, tgt, rank)
        resolved, reads, cs = S.plan_load(saved.storage, man, targets)
        want = plan_chunk_reads(v1, targets, "t", True)
        assert _reads(reads, targets) == _reads(want, targets) and reads
        assert 0 < cs.files <= src.world and cs.bytes > 0
        for t in targets:  # only chunks touching the target were resolved
            assert all(S._touches(c.box, t.box) for c in resolved.tensors[t.fqn].chunks)


def test_same_layout_load_reads_few_indexes():
    lay = S.Layout(2, 2, 4)
    saved, man = _save(lay)
    for rank in range(lay.world):
        _, _, cs = S.plan_load(saved.storage, man, S.load_targets(SPECS, TINY, lay, rank))
        assert cs.files <= lay.dp * lay.tp  # its own stage's writers at most, never every rank
        assert cs.bytes < sum(saved.storage.size(e.index) for e in man.ranks)


def test_pipeline_without_replicated_over_is_refused():
    got = S.pp_check(SPECS, TINY, S.Layout(2, 2, 2))
    assert got["short"] > 0 and got["short_listed"] > 0 and got["short_gridded"] > 0
    assert "replicated_over" in got["commit_error"]
    # one stage: nothing lies outside the mesh, and the adapters' view is complete
    one = S.pp_check(SPECS, TINY, S.Layout(2, 1, 2))
    assert one["short"] == 0 and one["commit_error"] == ""
    plain = S.plain_pp_check()
    assert plain["written"] == {0: ["model.a"], 1: []}
    assert plain["commit"].startswith("refused") and "replicated_over" in plain["commit"]


def test_simulate_and_report(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = S.Config(
        growth=[S.Layout(2, 2, 1), S.Layout(2, 2, 2)], extra=[S.Layout(1, 1, 4)],
        reshard=[(S.Layout(2, 2, 2), S.Layout(1, 1, 4))], save_sample=2, load_sample=1, reshard_sample=1,
        profile_layout=S.Layout(2, 2, 1), pp_check=S.Layout(2, 2, 1), model=TINY, check_tensors=50,
    )
    res = S.simulate(cfg, lambda s: None)
    res.update(elapsed_cpu_s=1.0, elapsed_wall_s=1.0, load_note="test")
    png, md = tmp_path / "scale.png", tmp_path / "scale.md"
    md.write_text("# Title\n\nhand-written\n\n" + S.BEGIN + "\nSTALE-GENERATED\n" + S.END + "\n\ntrailer\n")
    S.plot(res, str(png))
    S.write_markdown(res, str(md), "python bench/scale_sim.py", str(png))
    text = md.read_text()
    assert "hand-written" in text and "trailer" in text and "STALE-GENERATED" not in text
    assert "| TP2 PP2 DP2 |" in text and png.stat().st_size > 0
    rows = {r["layout"]: r for r in res["rows"]}
    assert rows["TP2 PP2 DP2"]["ranks"] == 8 and rows["FSDP2 4"]["grids"] == len(SPECS)
    assert all(r["chunks_checked"] > 0 and r["manifest_bytes"] > 0 and r["descriptors"] == r["pp"] for r in res["rows"])
    assert all(ld["chunks_checked"] > 0 for r in res["rows"] for ld in r["loads"])


def test_sample_ranks_cover_first_and_last_stage():
    lay = S.Layout(8, 16, 128)
    stages = {lay.coords(r)[0] for r in S.sample_ranks(lay, 6, random.Random(0))}
    assert {0, 15} <= stages


def test_gathered_bytes_are_statuses_plus_representatives():
    lay = S.Layout(2, 2, 3)
    saved = S.save_all(SPECS, TINY, lay, BLOCK)
    asked = [r for r, d in enumerate(saved.docs) if d != Documents()]
    assert asked == [0, lay.dp * lay.tp]  # the first rank of each stage
    assert all(len(b) == len(pickle.dumps(Documents())) for r, b in enumerate(saved.doc_blobs) if r not in asked)
