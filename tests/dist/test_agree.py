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
LOADS = ["load_misfit", "load_index", "load_failing"]


def _cause(case: str) -> str:
    """What the message of each case's error must say about the planted cause."""
    if "_check_" in case:
        return "'extra.odd' has dtype torch.uint32"
    if case.startswith("async_wait_lazy"):
        return "'model.dense.weight' changed in place after async_save() returned"
    if case == "load_misfit":
        return "'model.dense.weight': checkpoint has float32[4, 4], target has float32[5, 4]"
    return CAUSE


def _check(results: list[dict], cases: list[str]) -> None:
    """One error type on every rank, in time, naming the cause; the healthy rank names rank 1; nothing committed."""
    for case in cases:
        recs = [r[case] for r in results]
        types = {rec["type"] for rec in recs}
        assert len(types) == 1 and None not in types, (case, recs)
        cause = _cause(case)
        for rank, rec in enumerate(recs):
            assert rec["seconds"] < LIMIT, (case, rank, rec)
            assert cause in rec["message"], (case, rank, rec)
            assert "rank(s) [1]" in rec["message"], (case, rank, rec)
            if case.startswith("async_call_"):  # declared: the agreement raises it on every rank at the call
                assert rec["where"] == "call", (case, rank, rec)
            if case.startswith("async_wait_"):
                assert rec["where"] == "wait", (case, rank, rec)
            assert rec["kept"], (case, rank, rec)


@pytest.mark.parametrize("cases", [SAVES, ASYNC, LOADS], ids=["save", "async", "load"])
def test_failure_reaches_every_rank(tmp_path, cases):
    results = launch(2, "tests.dist.agree_cases:failures_job", {"root": str(tmp_path), "cases": cases}, timeout=240)
    _check(results, cases)
