"""A failure on one rank before the write, in every phase and feature, raises the same error on every rank in time.

Each launch is one process group running several cases (see
:mod:`tests.dist.agree_cases`): starting processes is the expensive part.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch
from tests.dist.agree_cases import CAUSE, LIMIT

pytestmark = pytest.mark.dist

SAVES = ["sync_plain", "sync_reduced", "sync_replicated", "sync_experts", "sync_check_reduced", "manager_reduced"]
ASYNC = [
    "async_call_eager_reduced", "async_call_lazy_experts", "async_call_check_eager_replicated",
    "async_wait_eager_reduced", "async_wait_lazy_reduced", "manager_async_reduced", "manager_async_check_plain",
]
# A Reduced tensor of another shape or dtype on rank 1; an adapter's implied rules that raise on rank 1.
RULES = [
    "sync_reduced_shape", "sync_reduced_dtype", "async_call_eager_reduced_shape", "async_call_lazy_reduced_shape",
    "sync_implied", "sync_implied_experts", "async_call_lazy_implied_experts", "prewarm_implied",
]
LOADS = ["load_misfit", "load_index", "load_failing", "load_meta", "load_implied", "load_reduced_misfit", "load_experts_misfit"]
MISFIT = {
    "load_misfit": ("model.dense.weight", "float32[4, 4]", "float32[5, 4]"),
    "load_reduced_misfit": ("extra.ema", "float32[3]", "float32[4]"),
    "load_experts_misfit": ("model.experts.1.weight", "float32[4, 4]", "float32[4, 5]"),
}


def _causes(case: str) -> tuple[str, ...]:
    """What the message of each case's error must say about the planted cause."""
    if "_check_" in case:
        return ("'extra.odd' has dtype torch.uint32",)
    if case.startswith("async_wait_lazy"):
        return ("'model.dense.weight' changed in place after async_save() returned",)
    if case in MISFIT:
        name, saved, target = MISFIT[case]
        return (f"'{name}': checkpoint has {saved}, target has {target}",)
    if case.endswith(("_shape", "_dtype")):  # the tensor, both ranks with what each holds, and the fix
        other = "float32[4]" if case.endswith("_shape") else "float64[3]"
        held = ("rank(s) [0] hold float32[3]", f"rank(s) [1] hold {other}")
        return ("Reduced tensor 'extra.ema'", *held, "same shape and dtype on every rank")
    return (CAUSE,)


def _check(results: list[dict], cases: list[str]) -> None:
    """One error type on every rank, in time, naming the cause; the healthy rank names rank 1; nothing committed."""
    for case in cases:
        recs = [r[case] for r in results]
        types = {rec["type"] for rec in recs}
        assert len(types) == 1 and None not in types, (case, recs)
        assert len({rec["message"] for rec in recs}) == 1, (case, recs)
        for rank, rec in enumerate(recs):
            assert rec["seconds"] < LIMIT, (case, rank, rec)
            assert all(cause in rec["message"] for cause in _causes(case)), (case, rank, rec)
            assert "rank(s) [1]" in rec["message"], (case, rank, rec)
            if case.startswith(("async_call_", "prewarm_")):  # declared: the agreement raises it on every rank at the call
                assert rec["where"] == "call", (case, rank, rec)
            if case.startswith("async_wait_"):
                assert rec["where"] == "wait", (case, rank, rec)
            assert rec["kept"], (case, rank, rec)


@pytest.mark.parametrize("cases", [SAVES, ASYNC, RULES, LOADS], ids=["save", "async", "rules", "load"])
def test_failure_reaches_every_rank(tmp_path, cases):
    results = launch(2, "tests.dist.agree_cases:failures_job", {"root": str(tmp_path), "cases": cases}, timeout=240)
    _check(results, cases)
