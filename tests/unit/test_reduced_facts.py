"""The facts of Reduced tensors that a save's ranks compare before reducing, and the error when they differ."""

from __future__ import annotations

import torch

import shardpoint as sp
from shardpoint.adapters import may_imply_rules, register_adapter, unregister_adapter
from shardpoint.saving.reduced import MARK, ReducedFact, fact_keys, fact_rows, mismatch_error
from tests.unit.models import ClaimsNothing


def test_fact_rows_travel_after_the_rows_and_come_back_apart():
    facts = [ReducedFact("extra.ema", (3,), "float32", "mean"), ReducedFact("extra.n", (), "int64", "sum")]
    other = torch.arange(12, dtype=torch.int64).reshape(2, 6)
    table = torch.cat([other, fact_rows(facts)])
    rest, keys = fact_keys(table)
    assert torch.equal(rest, other) and len(keys) == 2
    assert (table[2:, 0] == MARK).all()
    changed = fact_keys(fact_rows([ReducedFact("extra.ema", (4,), "float32", "mean"), facts[1]]))[1]
    assert changed != keys and {k[0] for k in changed} == {k[0] for k in keys}  # same names, other facts


def test_the_error_names_the_tensor_the_ranks_what_each_holds_and_the_fix():
    a, b = ReducedFact("extra.ema", (3,), "float32", "mean"), ReducedFact("extra.ema", (3,), "float64", "mean")
    err = mismatch_error("ckpt", [[a], [b], [a]])
    assert isinstance(err, sp.UnsupportedStateError)
    msg = str(err)
    assert "ckpt: Reduced tensor 'extra.ema' differs between ranks" in msg
    assert "rank(s) [0, 2] hold float32[3] (mean), rank(s) [1] hold float64[3] (mean)" in msg
    assert "same shape and dtype on every rank" in msg and "nothing was written" in msg
    absent = str(mismatch_error("ckpt", [[a], []]))
    assert "rank(s) [0] hold float32[3] (mean), rank(s) [1] hold no tensor of that name" in absent


class _Implies(ClaimsNothing):
    name = "implies"

    def implied_rules(self, state):
        raise RuntimeError("never asked of a plain save")


def test_an_adapter_that_implies_rules_makes_every_save_agree():
    state = {"w": torch.zeros(2)}
    assert not may_imply_rules(state)  # the built-in adapters: a plain save makes no exchange
    register_adapter(_Implies)
    try:
        assert may_imply_rules(state)
    finally:
        unregister_adapter("implies")
