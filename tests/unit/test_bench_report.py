"""The benchmark suite's pure helpers (bench/report.py): statistics, ratios, tables, merging."""

import os

import pytest

from bench import report as R


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_carryover_order_is_balanced(n):
    rows = [R.carryover_order(n, rep) for rep in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    per = len(rows) // n  # every system in every position this often
    for pos in range(n):
        assert sorted(row[pos] for row in rows) == sorted(list(range(n)) * per)
    after = {}
    for row in rows:
        for a, b in zip(row, row[1:]):
            after[(a, b)] = after.get((a, b), 0) + 1
    if n > 1:
        assert set(after) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(after.values())) == 1  # every ordered pair equally often
    assert R.carryover_order(n, len(rows)) == rows[0]  # the design repeats


def test_carryover_order_four_systems_exactly():
    assert [R.carryover_order(4, r) for r in range(4)] == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert R.carryover_order(0, 3) == []


def test_summary_median_min_max_and_none():
    assert R.summary([3, 1, 2, None]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert R.summary([4, 1]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 2}
    assert R.summary([]) == {"median": None, "min": None, "max": None, "n": 0}


def test_pooled_keeps_values_of_all_runs():
    s = R.pooled([1.0, 5.0], [3.0, None])
    assert s["values"] == [1.0, 5.0, 3.0]
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 3)


def test_rate_inverts_min_and_max():
    r = R.rate(2e9, {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3})
    assert r == {"median": 1.0, "min": 0.5, "max": 2.0, "n": 3}
    assert R.rate(None, {"median": 1.0, "min": 1.0, "max": 1.0}) is None
    assert R.rate(1e9, {"median": 0, "min": 0, "max": 0}) is None


def test_scaled_swaps_bounds_for_negative_factors():
    assert R.scaled({"median": 0.1, "min": -0.2, "max": 0.3, "n": 2}, 100) == pytest.approx(
        {"median": 10.0, "min": -20.0, "max": 30.0, "n": 2})
    assert R.scaled({"median": 1, "min": 0, "max": 2}, -1) == {"median": -1, "min": -2, "max": 0, "n": 0}
    assert R.scaled(None, 2) is None


def test_fraction_and_ratio():
    assert R.fraction(1.0, 4.0) == 0.25
    assert R.fraction(None, 4.0) is None
    assert R.fraction(1.0, 0.0) is None
    assert R.ratio(0.5, 2.0) == 0.25
    assert R.ratio(1.0, 0) is None


def test_formatting():
    assert R.fmt_summary({"median": 0.5, "min": 0.25, "max": 1.0}, 1000, 1) == "500.0 [250.0, 1000.0]"
    assert R.fmt_summary(None) == "n/a"
    assert R.fmt_ratio(0.644) == "0.64x"
    assert R.fmt_ratio(None) == "-"
    assert R.fmt_pct(0.412) == "41%"
    assert R.fmt_pct(None) == "n/a"
    assert R.fmt_num(None) == "n/a"


def test_markdown_table_escapes_and_checks_width():
    t = R.markdown_table(["a", "b"], [[1, "x|y"], [None, 2.5]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |", "| - | 2.5 |"]
    with pytest.raises(ValueError):
        R.markdown_table(["a", "b"], [[1]])


def test_merge_entries_replaces_same_key_in_place_and_appends_new():
    old = [{"part": "limits", "size": None, "layout": None, "v": 1},
           {"part": "sync", "size": "100mb", "layout": "ddp", "v": 1}]
    new = [{"part": "sync", "size": "100mb", "layout": "ddp", "v": 2},
           {"part": "sync", "size": "1.5gb", "layout": "ddp", "v": 2}]
    got = R.merge_entries(old, new)
    assert [(e["part"], e["size"], e["v"]) for e in got] == [("limits", None, 1), ("sync", "100mb", 2), ("sync", "1.5gb", 2)]


def test_suite_plan_quick_and_full():
    from bench import suite

    quick = suite.plan(True, ["100mb"], suite.PARTS, suite.LAYOUTS)
    assert [p["part"] for p in quick] == ["limits", "single", "sync", "sync", "sync", "async", "load"]
    assert {p["layout"] for p in quick if p["part"] == "sync"} == {"fsdp2", "ddp", "2d"}
    full = suite.plan(False, list(suite.SIZES), suite.PARTS, suite.LAYOUTS)
    assert len(full) == 1 + 2 * (1 + 3 + 3 + 1)
    for p in full:
        assert os.path.exists(os.path.join(suite.REPO, p["args"][0])), p["args"][0]
        if p["part"] == "async" and p["layout"] == "2d":
            assert "bcp" not in p["args"][p["args"].index("--systems") + 1].split(",")
    assert suite.render({"entries": []}) == ""
