"""DeepSpeed MoE experts inside ZeRO-1/2 engines: saved at one EP degree, loaded at another, bit-exact.

ZeRO partitions each MoE layer's experts over the expert data-parallel
group; their flat pieces are stored under the experts' global names. The
reference is DeepSpeed's own ``safe_get_full_*`` gathers (see
``tests/dist/ds_zero_moe_cases.py``). Needs ``deepspeed`` (run with
``DS_ACCELERATOR=cpu``); skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs

CASES = "tests.dist.ds_zero_moe_cases"
PER_TENSOR = 4  # fp32 master, the module's copy, exp_avg, exp_avg_sq
DENSE = 3  # the input projection's weight and bias, the gate


def _checked(ep: int) -> int:
    return PER_TENSOR * (2 * 4 // ep + DENSE)  # weight and bias of each local expert, and the dense tensors


def _load(root: str, world: int, ep: int, stage: int, saved_world: int, bf16: bool = False) -> list[dict]:
    args = {"root": root, "ep": ep, "stage": stage, "saved_world": saved_world, "bf16": bf16}
    results = launch(world, f"{CASES}:load_job", args)
    for r in results:
        assert r["bad"] == [] and r["checked"] == _checked(ep), r
        # the engine's MoE group keeps its own expert-parallel name, which DeepSpeed looks its groups up by
        assert r["groups"] == [["dense", False], [f"ep_size_{ep}", True]]
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds_zero_moe"))
    return root, launch(2, f"{CASES}:save_job", {"root": root, "ep": 2, "stage": 1})


def test_zero_experts_are_stored_at_their_global_index(saved):
    _, results = saved
    assert [r["offset"] for r in results] == [0, 2]
    want = sorted(f"model.moe.deepspeed_moe.experts.deepspeed_experts.{g}.{n}" for g in range(4) for n in ("weight", "bias"))
    assert all(r["experts"] == want for r in results)


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 2)], ids=["1rank-zero1", "2ranks-zero2"])
def test_ep2_zero1_loads_at_ep1(saved, world, stage):
    root, _ = saved
    _load(root, world, 1, stage, saved_world=2)


def test_ep1_zero2_loads_at_ep2_zero1(tmp_path):
    root = str(tmp_path)
    launch(2, f"{CASES}:save_job", {"root": root, "ep": 1, "stage": 2})
    assert [r["offset"] for r in _load(root, 2, 2, 1, saved_world=2)] == [0, 2]


def test_experts_split_over_expert_data_parallel_ranks_load_at_ep1(tmp_path):
    """4 ranks at EP 2: ZeRO-2 cuts each expert's flat group over 2 expert data-parallel ranks."""
    root = str(tmp_path)
    launch(4, f"{CASES}:save_job", {"root": root, "ep": 2, "stage": 2})
    _load(root, 2, 1, 1, saved_world=4)


def test_bf16_engine_with_fp32_masters_loads_at_ep1(tmp_path):
    """bf16 compute: the fp32 masters and moments are restored, and the module's bf16 copies refreshed from them."""
    root = str(tmp_path)
    launch(2, f"{CASES}:save_job", {"root": root, "ep": 2, "stage": 1, "bf16": True})
    _load(root, 1, 1, 2, saved_world=2, bf16=True)


def test_expert_parallel_parameter_outside_the_experts_is_refused(tmp_path):
    for r in launch(2, f"{CASES}:stray_job", {"root": str(tmp_path)}):
        assert r["error"] == "UnsupportedStateError" and not r["exists"], r
        assert "model.stray: a parameter of a DeepSpeed MoE optimizer group that is not a local expert" in r["message"]
