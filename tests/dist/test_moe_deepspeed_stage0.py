"""DeepSpeed MoE experts in a stage-0 engine (a torch AdamW, no ZeRO): saved at one EP degree, loaded at another.

The experts are stored at their global index, so each one's weights and
AdamW state load bit-exact at any EP degree. The optimizer's param groups
keep the loading engine's ``name`` (``ep_size_<ep>``) and ``moe`` keys:
DeepSpeed looks the expert-parallel process groups up by that name, and the
saved engine's name names a group that does not exist here. Rank functions
are in ``tests/dist/ds_stage0_moe_cases.py``. Needs ``deepspeed`` (run with
``DS_ACCELERATOR=cpu``); skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs

CASES = "tests.dist.ds_stage0_moe_cases"
DENSE = ["inp.bias", "inp.weight", "moe.deepspeed_moe.gate.wg.weight"]
PER_PARAM = 4  # the parameter, exp_avg, exp_avg_sq, step


def _params(ep: int, offset: int) -> list[str]:
    experts = [f"e{offset + i}.{n}" for i in range(4 // ep) for n in ("weight", "bias")]
    return sorted(experts + DENSE)


def _load(root: str, world: int, ep: int, saved_world: int) -> list[dict]:
    results = launch(world, f"{CASES}:load_job", {"root": root, "ep": ep, "saved_world": saved_world})
    for r in results:
        params = _params(ep, r["offset"])
        # every local expert at its global index, and the dense tensors, with their AdamW state
        assert r["bad"] == [] and r["checked"] == PER_PARAM * len(params), r
        assert r["groups"] == [["dense", False], [f"ep_size_{ep}", True]], r
        assert r["step_error"] is None and r["moved"] == params, r  # the loaded engine trains on
    return results


@pytest.fixture(scope="module")
def saved_ep2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds_stage0_moe"))
    results = launch(2, f"{CASES}:save_job", {"root": root, "ep": 2})
    for r in results:
        assert r["optimizer"] == "AdamW" and r["groups"] == [["dense", False], ["ep_size_2", True]], r
        assert r["entries"] == {"model": "deepspeed_zero0", "optimizer": "optimizer:AdamW"}, r
    assert [r["offset"] for r in results] == [0, 2]
    return root


def test_ep2_stage0_loads_at_ep1(saved_ep2):
    _load(saved_ep2, 1, 1, saved_world=2)


def test_ep1_stage0_loads_at_ep2(tmp_path):
    root = str(tmp_path)
    launch(2, f"{CASES}:save_job", {"root": root, "ep": 1})
    assert [r["offset"] for r in _load(root, 2, 2, saved_world=2)] == [0, 2]


def test_loaded_moe_groups_keep_their_name_for_a_later_zero_engine(saved_ep2):
    """Loaded before ``deepspeed.initialize``: ZeRO then finds the expert data-parallel group by the kept name."""
    for r in launch(1, f"{CASES}:zero_after_load_job", {"root": saved_ep2, "ep": 1}):
        assert r == {"groups": [["dense", False], ["ep_size_1", True]], "error": None}, r
