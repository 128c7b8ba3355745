"""The benchmark tools' pure parts: quoted figures read from the docs, comparison lines, the async call profile."""

import pathlib

import pytest

from bench import async_profile as AP
from bench import quoted as Q
from bench import report as R

REPO = pathlib.Path(__file__).resolve().parents[2]

DOC = """Intro text | with a bar.

| state | layout | system | stall ms | GB/s |
|---|---|---|---|---|
| 1461 MB | FSDP2 x4 | shardpoint lazy | 8.3 [8.1, 14.1] | 1.43 |
| 1461 MB | FSDP2 x4 | shardpoint eager | 183.4 [148.9, 197.3] | 0.50 |

| | shardpoint | DCP |
|---|---|---|
| bytes read / bytes needed | 0.94 with shared reads, 1.36 without | 1.39 |
"""


def fig(row, column, nth=0):
    return Q.Figure("x", "doc.md", row, column, "ms", "async", ("stall", "sp-lazy"), Q.ASYNC, nth=nth)


def test_table_cell_finds_the_row_by_its_leading_cells_and_the_column_by_its_header():
    assert Q.table_cell(DOC, ("1461 MB", "FSDP2 x4", "shardpoint eager"), "stall ms") == "183.4 [148.9, 197.3]"
    assert Q.table_cell(DOC, ("1461 MB", "FSDP2 x4", "shardpoint lazy"), "GB/s") == "1.43"
    assert Q.table_cell(DOC, ("bytes read / bytes needed",), "DCP") == "1.39"


def test_table_cell_is_none_for_a_missing_row_or_column():
    assert Q.table_cell(DOC, ("1461 MB", "DDP x4", "shardpoint lazy"), "stall ms") is None
    assert Q.table_cell(DOC, ("1461 MB", "FSDP2 x4", "shardpoint lazy"), "stall s") is None
    assert Q.table_cell(DOC, ("1461 MB",), "GB/s") == "1.43"  # the first row that starts so


def test_quoted_value_takes_the_nth_number_of_the_cell():
    assert Q.quoted_value(DOC, fig(("1461 MB", "FSDP2 x4", "shardpoint lazy"), "stall ms")) == 8.3
    row = ("bytes read / bytes needed",)
    assert Q.quoted_value(DOC, fig(row, "shardpoint")) == 0.94
    assert Q.quoted_value(DOC, fig(row, "shardpoint", nth=1)) == 1.36
    assert Q.quoted_value(DOC, fig(row, "shardpoint", nth=2)) is None
    assert Q.quoted_value(DOC, fig(("gone",), "shardpoint")) is None


def test_an_edited_doc_is_compared_with_its_new_figure():
    edited = DOC.replace("| 8.3 [8.1, 14.1] |", "| 98.0 [90.1, 120.0] |")
    assert Q.quoted_value(edited, fig(("1461 MB", "FSDP2 x4", "shardpoint lazy"), "stall ms")) == 98.0


def test_every_figure_is_found_in_the_repository_docs():
    texts = {f: (REPO / f).read_text(encoding="utf-8") for f in {x.file for x in Q.FIGURES}}
    found = {(f.file, f.label): Q.quoted_value(texts[f.file], f) for f in Q.FIGURES}
    assert [k for k, v in found.items() if v is None] == []
    assert {f.run for f in Q.FIGURES} == set(Q.QUICK)


def test_compare_line_gives_the_ratio_and_flags_past_the_factor():
    line = R.compare_line("lazy stall", 12.1, 8.3, "ms", "last recorded (commit abc123)")
    assert line == "lazy stall 12.1 ms, last recorded (commit abc123) 8.3 ms: 1.46x"
    assert R.compare_line("lazy stall", 98.0, 8.3, "ms", "quoted", factor=3).endswith("11.81x  <-- OFF BY MORE THAN 3x")
    assert R.compare_line("save", 0.4, 1.43, "GB/s", "quoted", factor=3, digits=2).endswith("0.28x  <-- OFF BY MORE THAN 3x")
    assert R.compare_line("save", 1.0, 1.43, "GB/s", "quoted", factor=3, digits=2) == "save 1.00 GB/s, quoted 1.43 GB/s: 0.70x"
    assert R.compare_line("x", None, 2.0, "ms", "quoted", factor=3) == "x n/a, quoted 2.0 ms: -"


def suite(stall_lazy, call_lazy, git):
    systems = [{"system": "sp-lazy", "stall_s": {"median": stall_lazy}, "call_s": {"median": call_lazy}},
               {"system": "dcp-thread", "stall_s": {"median": 0.4}, "call_s": {"median": 0.4}},
               {"system": "sp-eager", "error": "failed"}]
    return {"entries": [{"part": "async", "size": "100mb", "layout": "fsdp2", "result": {"git": git, "systems": systems}},
                        {"part": "single", "size": "100mb", "layout": "single", "result": {}}]}


def test_async_call_report_prints_this_run_beside_the_last_recorded():
    lines = R.async_call_report(suite(0.0083, 0.0050, "abc123"), suite(0.0121, 0.0060, "def456"))
    assert lines == [
        "sp-lazy stall 100mb fsdp2 12.1 ms, last recorded (commit abc123) 8.3 ms: 1.46x",
        "sp-lazy call 100mb fsdp2 6.0 ms, last recorded (commit abc123) 5.0 ms: 1.20x",
    ]
    assert R.async_call_report(None, suite(0.0121, 0.0060, "x"))[0] == "sp-lazy stall 100mb fsdp2 12.1 ms, none recorded n/a: -"
    assert R.async_call_report(suite(0.1, 0.1, "a"), {"entries": []}) == []


def test_call_profile_splits_the_call_into_phases():
    steps = {"check": 0.001, "groups": 0.002, "prepare": 0.005, "stage": 0.003, "snapshot": 0.010, "digests": 0.004}
    timings = {"plan": 0.004, "snapshot": 0.009, "blocked": 0.02, "write": 1.0}
    p = AP.call_profile(steps, timings, call_s=0.025, wait_s=0.001, fence_s=0.002)
    assert list(p) == list(AP.PHASES)
    expect = {"wait": 0.001, "check": 0.001, "groups": 0.002, "prepare": 0.001, "plan": 0.004, "stage": 0.003,
              "copies": 0.005, "digests": 0.004, "guard": 0.001, "other": 0.004, "call": 0.025, "fence": 0.002, "stall": 0.028}
    assert p == pytest.approx(expect, abs=1e-12)


def test_median_profile_and_table():
    m = AP.median_profile([{"call": 0.001}, {"call": 0.003, "plan": 0.001}, {"call": 0.002}])
    assert m["call"] == 0.002 and m["plan"] == 0.0 and set(m) == set(AP.PHASES)
    assert AP.median_profile([]) == {}
    table = AP.profile_table("sp-lazy", [m, {}]).splitlines()
    assert table[0].startswith("# sp-lazy call profile, ms")
    assert table[1].split() == ["rank", *AP.PHASES]
    assert len(table) == 3  # a rank with no profile has no row
    assert table[2].split()[0] == "0" and table[2].split()[AP.PHASES.index("call") + 1] == "2.0"
