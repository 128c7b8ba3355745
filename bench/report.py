"""Pure helpers of the benchmark suite: statistics, ratios, fractions of a limit, markdown tables.

No torch, no I/O: the suite driver and the benchmark scripts use these, and
``tests/unit/test_bench_report.py`` checks them.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence


def carryover_order(n: int, rep: int) -> list[int]:
    """The order of ``n`` systems in repeat ``rep``: a Williams design, balanced for what ran just before.

    Across ``n`` consecutive repeats (``2n`` when ``n`` is odd) each system
    runs once in every position, and every system runs right after every
    other system equally often inside a repeat. Rotating one list instead
    keeps its cyclic order, so the system after DCP in the list would run
    right after DCP in every repeat but one in ``n``.
    """
    if n <= 0:
        return []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    r = rep % (n if n % 2 == 0 else 2 * n)
    if r < n:
        return [(x + r) % n for x in base]
    return [(x + r - n) % n for x in reversed(base)]


def summary(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min, max and count of ``values`` (None values skipped; None fields when empty)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def pooled(*groups: Iterable[float | None]) -> dict[str, Any]:
    """One :func:`summary` over the values of several runs, with the values kept."""
    vals = [float(x) for g in groups for x in g if x is not None]
    return {**summary(vals), "values": vals}


def scaled(s: dict | None, factor: float | None) -> dict | None:
    """A summary with median, min and max multiplied by ``factor`` (min/max swap for negative)."""
    if not s or s.get("median") is None or factor is None:
        return None
    lo, hi = s["min"] * factor, s["max"] * factor
    return {"median": s["median"] * factor, "min": min(lo, hi), "max": max(lo, hi), "n": s.get("n", 0)}


def rate(nbytes: float | None, seconds: dict | None) -> dict | None:
    """GB/s summary of moving ``nbytes`` in the times of ``seconds`` (a summary): max speed from min time."""
    if not nbytes or not seconds or seconds.get("median") in (None, 0) or not seconds.get("min"):
        return None
    return {"median": nbytes / seconds["median"] / 1e9, "min": nbytes / seconds["max"] / 1e9,
            "max": nbytes / seconds["min"] / 1e9, "n": seconds.get("n", 0)}


def fraction(value: float | None, limit: float | None) -> float | None:
    """``value / limit``, or None when either is missing or the limit is not positive."""
    if value is None or limit is None or limit <= 0:
        return None
    return value / limit


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` (e.g. shardpoint's median over the anchor's), None when undefined."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_summary(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """``median [min, max]`` of a summary, scaled; ``n/a`` when empty."""
    if not s or s.get("median") is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'] * scale)} [{f.format(s['min'] * scale)}, {f.format(s['max'] * scale)}]"


def fmt_num(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def fmt_ratio(x: float | None) -> str:
    """``0.64x``; ``-`` when undefined."""
    return "-" if x is None else f"{x:.2f}x"


def fmt_pct(x: float | None, digits: int = 0) -> str:
    """A fraction as a percentage: 0.412 -> ``41%``."""
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; ``|`` inside cells is escaped, None shows as ``-``."""
    def cell(x: Any) -> str:
        return "-" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row has {len(r)} cells, the header {len(headers)}: {r!r}")
        out.append("| " + " | ".join(cell(x) for x in r) + " |")
    return "\n".join(out)


def merge_entries(old: list[dict], new: list[dict], key=("part", "size", "layout")) -> list[dict]:
    """Entries of ``old`` replaced by the ``new`` entries with the same key, new ones appended in order."""
    def k(e: dict) -> tuple:
        return tuple(e.get(x) for x in key)

    fresh = {k(e): e for e in new}
    out = [fresh.pop(k(e)) if k(e) in fresh else e for e in old]
    out.extend(e for e in new if k(e) in fresh)
    return out


def compare_line(label: str, fresh: float | None, before: float | None, unit: str, where: str,
                 factor: float | None = None, digits: int = 1) -> str:
    """A fresh figure beside an earlier one, with their ratio; flagged when off by more than ``factor`` either way.

    ``compare_line("lazy stall", 12.1, 8.3, "ms", "last recorded (commit abc123)")`` ->
    ``lazy stall 12.1 ms, last recorded (commit abc123) 8.3 ms: 1.46x``.
    """
    f = f"{{:.{digits}f}} {unit}"
    now = "n/a" if fresh is None else f.format(fresh)
    then = "n/a" if before is None else f.format(before)
    r = ratio(fresh, before)
    line = f"{label} {now}, {where} {then}: {fmt_ratio(r)}"
    if factor is not None and r is not None and r > 0 and max(r, 1 / r) > factor:
        line += f"  <-- OFF BY MORE THAN {factor:g}x"
    return line


def recorded_async(data: dict | None) -> dict[tuple, dict]:
    """From a suite JSON: per (size, layout, system) of the async part, the median stall and call (s) and the commit."""
    out: dict[tuple, dict] = {}
    for e in (data or {}).get("entries", []):
        if e.get("part") != "async" or "result" not in e:
            continue
        git = e["result"].get("git") or "?"
        for s in e["result"].get("systems", []):
            if "error" in s or "stall_s" not in s:
                continue
            out[(e["size"], e["layout"], s["system"])] = {
                "stall_s": s["stall_s"].get("median"), "call_s": (s.get("call_s") or {}).get("median"), "git": git}
    return out


def async_call_report(before: dict | None, after: dict, systems=("sp-lazy", "sp-eager")) -> list[str]:
    """Lines comparing this run's shardpoint stall and call times with the last recorded ones; never a verdict.

    Example::

        print("\\n".join(async_call_report(old_suite_json, new_suite_json)))
    """
    old, new = recorded_async(before), recorded_async(after)
    lines = []
    for key in sorted(k for k in new if k[2] in systems):
        size, layout, system = key
        prev = old.get(key)
        where = f"last recorded (commit {prev['git']})" if prev else "none recorded"
        for what in ("stall", "call"):
            fresh, then = new[key][f"{what}_s"], (prev or {}).get(f"{what}_s")
            lines.append(compare_line(f"{system} {what} {size} {layout}", None if fresh is None else fresh * 1e3,
                                      None if then is None else then * 1e3, "ms", where))
    return lines
