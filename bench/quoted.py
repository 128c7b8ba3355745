"""Re-measure the figures README.md and docs/benchmarks.md quote, quickly, and print each beside its quoted value.

How the quoted values are found: a small table (``FIGURES``) names each
quoted figure by where it is quoted (a file, the leading cells of its table
row, the column's header, and which number of the cell) and by the suite
piece that produced it. The value itself is read from the doc on every run,
so an edited doc is compared automatically, and a figure whose row or column
is gone is reported as not found instead of compared against a stale number.
Scanning the docs for any number would not know which command produced it;
the table is that knowledge, kept small.

The quick runs use the 100 MB state (the quoted figures are at 1.46 GB), so
they catch gross changes only: a figure is flagged when the fresh value is
off from the quoted one by more than ``--factor`` (default 3) either way. The
eager stall grows with the state's bytes, so its fresh value is scaled to the
quoted state's size first; the lazy stall, throughputs and bytes-read ratios
are compared as they are. This is a tool, not a test: it prints, it fails
nothing.

    python bench/quoted.py --dry-run            # the quoted values found, and the commands it would run
    python bench/quoted.py                      # run the quick measurements (a few minutes)
    python bench/quoted.py --only async --world 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import report as R  # noqa: E402
import suite as S  # noqa: E402

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Figure:
    """One quoted figure: where it is quoted, the suite piece that produced it, and what measures it quickly."""

    label: str
    file: str  # relative to the repository
    row: tuple[str, ...]  # the leading cells of its table row
    column: str  # the header of its column
    unit: str
    run: str  # the quick run that measures it: a key of QUICK
    measure: tuple[str, ...]  # what to take from that run's JSON (see fresh_value)
    piece: tuple[str, str, str]  # (part, size, layout) of the suite piece that produced it
    nth: int = 0  # which number of the cell
    per_byte: bool = False  # scale the fresh value to the quoted state's bytes


BIG_BYTES = 1461e6  # the 1.5gb state's bytes, which the quoted figures are of
ASYNC = ("async", "1.5gb", "fsdp2")
SINGLE = ("single", "1.5gb", "single")
LOAD = ("load", "1.5gb", "fsdp2")
DOC = "docs/benchmarks.md"
FIGURES = (
    Figure("lazy stall, FSDP2 x4", "README.md", ("time training is blocked by an async save, FSDP2 x4, 1.46 GB",),
           "shardpoint", "ms", "async", ("stall", "sp-lazy"), ASYNC),
    Figure("lazy stall, FSDP2 x4", DOC, ("1461 MB", "FSDP2 x4", "shardpoint lazy"), "stall ms", "ms", "async",
           ("stall", "sp-lazy"), ASYNC),
    Figure("eager stall, FSDP2 x4", DOC, ("1461 MB", "FSDP2 x4", "shardpoint eager"), "stall ms", "ms", "async",
           ("stall", "sp-eager"), ASYNC, per_byte=True),
    Figure("single-process save", DOC, ("1461 MB", "save", "shardpoint"), "GB/s", "GB/s", "single",
           ("gbps", "save"), SINGLE),
    Figure("single-process cold load", DOC, ("1461 MB", "load cold", "shardpoint"), "GB/s", "GB/s", "single",
           ("gbps", "load_cold"), SINGLE),
    Figure("single-process warm load", DOC, ("1461 MB", "load warm", "shardpoint"), "GB/s", "GB/s", "single",
           ("gbps", "load_warm"), SINGLE),
    Figure("resharding load read/needed, shared reads", "README.md",
           ("bytes read / bytes needed, FSDP2 x4 checkpoint into TP x2, 1.46 GB",), "shardpoint", "", "load",
           ("read_ratio", "sp-share"), LOAD),
    Figure("resharding load read/needed, no sharing", "README.md",
           ("bytes read / bytes needed, FSDP2 x4 checkpoint into TP x2, 1.46 GB",), "shardpoint", "", "load",
           ("read_ratio", "sp-noshare"), LOAD, nth=1),
    Figure("resharding load read/needed, shared reads", DOC, ("1461 MB", "TP x2 (resharding)", "shardpoint (share_reads)"),
           "read / needed", "", "load", ("read_ratio", "sp-share"), LOAD),
    Figure("resharding load read/needed, no sharing", DOC, ("1461 MB", "TP x2 (resharding)", "shardpoint (no sharing)"),
           "read / needed", "", "load", ("read_ratio", "sp-noshare"), LOAD),
)

# The quick runs: the suite's scripts on the 100 MB state with few repeats (the JSON path is appended).
QUICK = {
    "async": ["bench/bench_async.py", "--size", "100mb", "--layout", "fsdp2", "--systems", "sp-eager,sp-lazy",
              "--checkpoints", "2", "--every", "5"],
    "single": ["bench/bench_single.py", "--size", "100mb", "--repeats", "3", "--no-limits"],
    "load": ["bench/bench_load.py", "--size", "100mb", "--targets", "tp-2", "--systems", "sp-share,sp-noshare",
             "--repeats", "1"],
}


def table_cell(text: str, row: tuple[str, ...], column: str) -> str | None:
    """The cell under ``column`` of the markdown table row whose leading cells are ``row``; None when absent.

    >>> table_cell("| a | b |\\n|---|---|\\n| x | 1.5 ms |", ("x",), "b")
    '1.5 ms'
    """
    header: list[str] | None = None
    prev: list[str] | None = None
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("|"):
            header = prev = None
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if all(set(c) <= set("-: ") and c for c in cells):  # the separator: the line before was the header
            header = prev
            continue
        prev = cells
        if header and tuple(cells[: len(row)]) == row and column in header:
            i = header.index(column)
            return cells[i] if i < len(cells) else None
    return None


def quoted_value(text: str, fig: Figure) -> float | None:
    """The figure's number as the doc's text quotes it; None when its row, column or number is gone."""
    cell = table_cell(text, fig.row, fig.column)
    nums = NUMBER.findall(cell or "")
    return float(nums[fig.nth]) if len(nums) > fig.nth else None


def fresh_value(run: str, res: dict, measure: tuple[str, ...]) -> tuple[float | None, float | None]:
    """The fresh value of ``measure`` from a quick run's JSON, and the state's bytes it was measured on."""
    kind, name = measure
    if run == "async":
        s = next((x for x in res.get("systems", []) if x.get("system") == name and "error" not in x), None)
        return (s["stall_s"]["median"] * 1e3, s.get("state_bytes")) if s else (None, None)
    if run == "single":
        sys_ = res.get("summary", {}).get(name, {}).get("shardpoint")
        return (sys_["gbps"]["median"], res.get("state_bytes")) if sys_ else (None, None)
    if run == "load":
        r = next((x for x in res.get("loads", []) if x.get("system") == name and x.get("target") == "tp-2" and x.get("ok")), None)
        if r is None:
            return None, None
        read = r["storage_bytes_read"]["median"] if "storage_bytes_read" in r else r["rchar_sum"]["median"]
        return read / r["needed_bytes"], None
    raise ValueError(f"unknown quick run {run!r}: one of {', '.join(QUICK)}")


def piece_command(piece: tuple[str, str, str]) -> str:
    """The command of the suite piece that produced a quoted figure (see ``bench/suite.py --dry-run``)."""
    part, size, layout = piece
    for p in S.plan(False, [size], [part], list(S.LAYOUTS)):
        if p["part"] == part and p["layout"] == layout:
            return "python " + " ".join(p["args"])
    return f"bench/suite.py --sizes {size} --parts {part}"


def quick_command(run: str, world: int) -> list[str]:
    """The quick run's arguments (without the interpreter and --json)."""
    args = list(QUICK[run])
    if run == "async" and world != 4:
        args += ["--world", str(world)]
    return args


def report_figure(fig: Figure, quoted: float | None, fresh: float | None, fresh_bytes: float | None, factor: float) -> str:
    """Two lines: the fresh value beside the quoted one (flagged past ``factor``), and the command that produced it."""
    note = ""
    if fig.per_byte and fresh is not None and fresh_bytes:
        fresh, note = fresh * BIG_BYTES / fresh_bytes, f" (scaled from {fresh_bytes / 1e6:.0f} MB)"
    digits = 3 if not fig.unit else (1 if fig.unit == "ms" else 2)
    line = R.compare_line(f"{fig.label}{note}:", fresh, quoted, fig.unit, f"quoted in {fig.file}", factor, digits)
    return f"{line}\n    re-measure at full size with: {piece_command(fig.piece)}"


def run_quick(run: str, world: int, tmp: str) -> dict | None:
    out = os.path.join(tmp, f"{run}.json")
    cmd = [sys.executable, *quick_command(run, world), "--json", out]
    print("# running: " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        print(f"# {run} failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return None
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the quoted values found and the commands, run nothing")
    ap.add_argument("--only", default=",".join(QUICK), help=f"comma-separated quick runs: {','.join(QUICK)}")
    ap.add_argument("--factor", type=float, default=3.0, help="flag a fresh value off by more than this factor (default 3)")
    ap.add_argument("--world", type=int, default=4, help="ranks of the quick async run (the quoted figures: 4)")
    args = ap.parse_args(argv)
    runs = [r for r in args.only.split(",") if r]
    bad = [r for r in runs if r not in QUICK]
    if bad:
        ap.error(f"unknown quick runs {bad}: one of {', '.join(QUICK)}")
    texts = {f: open(os.path.join(REPO, f), encoding="utf-8").read() for f in {fig.file for fig in FIGURES}}
    figs = [(fig, quoted_value(texts[fig.file], fig)) for fig in FIGURES if fig.run in runs]
    missing = [fig for fig, q in figs if q is None]
    if args.dry_run:
        for fig, q in figs:
            where = f"{fig.file}: row {' | '.join(fig.row)!r}, column {fig.column!r}"
            print(f"{fig.label}: quoted {'NOT FOUND' if q is None else f'{q:g} {fig.unit}'.strip()} ({where})")
            print(f"    re-measure at full size with: {piece_command(fig.piece)}")
        for run in runs:
            print(f"quick run {run}: python {' '.join(quick_command(run, args.world))} --json <tmp>")
        return 0
    with tempfile.TemporaryDirectory(prefix="sp-bench-quoted-") as tmp:
        results = {run: run_quick(run, args.world, tmp) for run in runs}
    print(f"\n# fresh quick values (100 MB state) against the quoted ones (1.46 GB); flagged past {args.factor:g}x")
    for fig, q in figs:
        res = results.get(fig.run)
        fresh, nbytes = fresh_value(fig.run, res, fig.measure) if res else (None, None)
        print(report_figure(fig, q, fresh, nbytes, args.factor))
    for fig in missing:
        print(f"# not found in {fig.file}: row {' | '.join(fig.row)!r}, column {fig.column!r}: update FIGURES in bench/quoted.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
