"""FSDP1 flat parameters and pipeline stages, saved and loaded across layouts as real gloo processes.

Each launch is one process group running several cases, because starting
processes is the expensive part on a small machine.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch
from tests.dist.checks import check_ranks_agree

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    info = {}
    info.update(launch(4, "tests.dist.layout_cases:save_job", {"root": root, "layouts": ["fsdp1", "pp_ddp", "pp_fsdp2", "fsdp1_hybrid"]})[0])
    info.update(launch(2, "tests.dist.layout_cases:save_job", {"root": root, "layouts": ["fsdp2", "pp"]})[0])
    info.update(launch(3, "tests.dist.layout_cases:save_job", {"root": root, "layouts": ["fsdp1_orig"]})[0])
    return root, info


def test_saves_are_flat_slices_without_gather(saved):
    _, info = saved
    total = info["fsdp22"]["total"]
    for name in ("fsdp14", "pp_ddp4", "pp_fsdp24", "pp2", "fsdp1_orig3", "fsdp1_hybrid4"):
        want = total - (7 * 4 if name == "pp2" else 0)  # pp2 saves no extra tensor
        assert info[name]["total"] == want, (name, info[name], want)
    # FSDP1 stores flat ranges of the original parameters, and nothing twice.
    assert info["fsdp14"]["flat_chunks"] > 0 and info["fsdp1_orig3"]["flat_chunks"] > 0
    assert info["fsdp22"]["flat_chunks"] == info["pp2"]["flat_chunks"] == 0


@pytest.mark.parametrize(
    "world,cases",
    [
        (1, [["fsdp14", "single"], ["pp2", "single"], ["pp_ddp4", "single"], ["fsdp1_orig3", "single"], ["fsdp1_hybrid4", "single"]]),
        (2, [["fsdp14", "fsdp2"], ["fsdp22", "pp"], ["pp_fsdp24", "fsdp1_orig"], ["fsdp1_orig3", "fsdp1"]]),
        (3, [["fsdp22", "fsdp1_orig"], ["fsdp14", "fsdp1_orig"], ["pp2", "fsdp1"]]),
        (4, [["fsdp22", "pp_ddp"], ["fsdp1_orig3", "pp_fsdp2"], ["pp2", "fsdp1"], ["fsdp1_hybrid4", "fsdp1_hybrid"], ["pp_ddp4", "fsdp1_hybrid"]]),
    ],
    ids=["to1", "to2", "to3", "to4"],
)
def test_layout_reshard(saved, world, cases):
    root, _ = saved
    results = launch(world, "tests.dist.layout_cases:load_job", {"root": root, "cases": cases})
    check_ranks_agree(results, cases, world)


def test_pipeline_save_without_replica_groups_fails_loudly(tmp_path):
    results = launch(2, "tests.dist.layout_cases:pp_guard_job", {"root": str(tmp_path)})
    for r in results:
        assert r["error"] is not None and "replicated_over" in r["error"], r


def test_fsdp1_never_stepped_optimizer(tmp_path):
    results = launch(2, "tests.dist.layout_cases:fsdp1_stateless_job", {"root": str(tmp_path)})
    for r in results:
        assert r["fsdp1"] == [] and r["fsdp1_orig"] == [], r
        assert r["fsdp1_state_after"] == 0 and r["fsdp1_orig_state_after"] == 0, r
