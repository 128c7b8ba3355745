"""Process-free checks of bench/scale_sim.py on a tiny model: the simulated geometry is torch's,
every simulated save is a valid checkpoint, and the prototype finds exactly the real planner's reads."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from bench import scale_sim as S
from shardpoint.engine.load import LoadStats, plan_chunk_reads
from shardpoint.format.manifest import Manifest

TINY = S.ModelSpec(layers=4, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=40, vocab=50)


@pytest.mark.parametrize("tp,dp", [(1, 4), (1, 7), (2, 3), (2, 8), (4, 8)])
@pytest.mark.parametrize("shape,style", [((52, 16), "col"), ((12, 6), "col"), ((16, 40), "row"), ((16,), "rep"), ((7, 5), "row")])
def test_shard_box_is_torchs(shape, style, tp, dp):
    # Column-parallel dims divide by tp here, as in the 70B model: otherwise torch's
    # _StridedShard rows are not one contiguous box (and FSDP2's local shape differs).
    lay = S.Layout(tp, 1, dp)
    boxes = []
    for d, t in itertools.product(range(dp), range(tp)):
        want = S.torch_shard_box(shape, style, lay, d, t)
        assert S.shard_box(shape, style, lay, d, t) == want
        boxes.append(want)
    # the distinct boxes tile the tensor exactly once
    distinct = {b for b in boxes if b.numel}
    assert sum(b.numel for b in distinct) == math.prod(shape)


def _save(lay: S.Layout, mode: str = "pp-aware"):
    specs = S.state_tensors(TINY)
    gathered, written = [], {}
    for r in range(lay.world):
        tensors = S.rank_tensors(specs, TINY, lay, r, mode=mode)
        mine = S.pick_mine(tensors)
        for t in mine:
            written[t.fqn] = written.get(t.fqn, 0) + t.box.numel
        gathered.append(S.Outcome(True, S.rank_summary(r, tensors, mine, 64)))
    return specs, gathered, written


@pytest.mark.parametrize("lay", [S.Layout(2, 2, 3), S.Layout(1, 1, 6), S.Layout(2, 4, 2), S.Layout(4, 1, 1)])
def test_every_tensor_written_once_and_commit_round_trips(lay):
    specs, gathered, written = _save(lay)
    assert written == {s.fqn: math.prod(s.shape) for s in specs}
    storage = S.MemoryStorage()
    S._commit(storage, S.SAVE_ID, lay.world, 64, gathered, "t")
    man = Manifest.from_json(storage.get(S.MANIFEST_NAME))
    assert len(man.tensors) == len(specs)


def test_default_adapters_lose_chunks_under_pipeline_parallelism():
    assert S.pp_check(S.state_tensors(TINY), TINY, S.Layout(2, 2, 2))["short"] > 0
    assert S.pp_check(S.state_tensors(TINY), TINY, S.Layout(2, 1, 2))["short"] == 0


@pytest.mark.parametrize("src,tgt", [(S.Layout(2, 2, 3), S.Layout(1, 1, 5)), (S.Layout(1, 1, 5), S.Layout(2, 2, 3)), (S.Layout(4, 1, 2), S.Layout(2, 4, 1))])
def test_prototype_matches_manifest_and_planner(src, tgt):
    specs = S.state_tensors(TINY)
    v2 = S.V2Store(specs, TINY, src, 64)
    res, data = S.run_save(specs, TINY, src, 64, [0], trace=False, profile=False, v2=v2)
    man = S.parse_manifest(res, data, trace=False, profile=False)
    v2.man = S.V2Store.parse(v2.commit())
    assert v2.check_manifest(man, [s.fqn for s in specs]) == sum(1 for t in man.tensors.values() for c in t.chunks if c.numel or not t.shape)
    for rank in range(tgt.world):  # every target rank: the same reads, byte offsets included
        targets = S.load_targets(specs, TINY, tgt, rank)
        reads = plan_chunk_reads(man, targets, "t", True, LoadStats())
        ops, _nbytes, _nrows, _nfiles = v2.plan(targets, tgt, rank)
        S.V2Store.check_against(ops, reads)


def test_simulate_and_report(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = S.Config(
        growth=[S.Layout(2, 2, 1), S.Layout(2, 2, 2)], extra=[S.Layout(1, 1, 4)],
        reshard=[(S.Layout(2, 2, 2), S.Layout(1, 1, 4))], save_sample=2, load_sample=1, reshard_sample=1,
        profile_layout=S.Layout(2, 2, 1), pp_check=S.Layout(2, 2, 1), model=TINY,
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
    assert all(r["chunks"] > 0 for r in res["rows"])


def test_sample_ranks_cover_first_and_last_stage():
    lay = S.Layout(8, 16, 128)
    stages = {lay.coords(r)[0] for r in S.sample_ranks(lay, 6, random.Random(0))}
    assert {0, 15} <= stages
