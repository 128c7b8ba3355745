"""Replica row keys kept by a saver's RowKeys: equal tables, and only new pieces hashed."""

from __future__ import annotations

import torch

from shardpoint.planning import replicas
from shardpoint.planning.replicas import ReplicaTable, Row, RowKeys, encode_rows


def _rows(names):
    return [Row(n, (0, 0), (4, 8), None, "dp", (1, 2, 3, 4)) for n in names]


def test_kept_keys_give_the_same_table_and_hash_only_new_pieces(monkeypatch):
    plain = encode_rows(_rows(["a", "b"]))
    keys = RowKeys()
    calls = []
    real = replicas._key
    monkeypatch.setattr(replicas, "_key", lambda *p: (calls.append(p), real(*p))[1])
    assert torch.equal(encode_rows(_rows(["a", "b"]), keys), plain)
    assert len(calls) == 3  # two pieces and their one group
    calls.clear()
    assert torch.equal(encode_rows(_rows(["a", "b"]), keys), plain)
    assert calls == []
    both = encode_rows(_rows(["a", "c"]), keys)
    assert calls == [("c", (0, 0), (4, 8), None)]
    assert torch.equal(both, encode_rows(_rows(["a", "c"])))


def test_only_the_last_table_is_kept(monkeypatch):
    keys = RowKeys()
    encode_rows(_rows(["a"]), keys)
    encode_rows(_rows(["b"]), keys)
    calls = []
    real = replicas._key
    monkeypatch.setattr(replicas, "_key", lambda *p: (calls.append(p), real(*p))[1])
    encode_rows(_rows(["a"]), keys)
    assert calls == [("a", (0, 0), (4, 8), None)]


def test_a_replica_table_with_kept_keys_is_the_same():
    held = [("w", (0,), (4,), None, "", (0, 1, 2, 3))]
    keys = RowKeys()
    first = ReplicaTable.of(held, keys)
    assert ReplicaTable.of(held, keys).encoded == first.encoded == ReplicaTable.of(held).encoded
