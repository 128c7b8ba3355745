"""The subcommands that read: inspect, verify and diff checkpoints, and summarise a trace folder."""

from __future__ import annotations

import json
import sys

from ..api import read_manifest
from ..convert.consolidate import describe_references
from ..convert.verify import verify_checkpoint
from .common import add_command, add_quiet, console, dump, human, new_table

__all__ = ["add_inspect", "add_verify", "add_diff", "add_trace", "run_inspect", "run_verify", "run_diff", "run_trace"]


def run_inspect(args) -> int:
    """List a checkpoint's tensors, one tensor's chunks, or draw a shard map; the exit status."""
    from ..convert.shardmap import chunk_table, plot_shard_map

    m = read_manifest(args.path)
    if args.plot:
        n = plot_shard_map(m, args.plot, keys=args.keys, max_tensors=args.max_tensors)
        if not args.json and not args.tensor:
            print(f"wrote a shard map of {n} tensor(s) to {args.plot}", file=sys.stderr)
    if args.tensor:
        rows = chunk_table(m, args.tensor)
        t = m.tensors[args.tensor]
        if args.json:
            dump({"tensor": args.tensor, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": rows})
            return 0
        table = new_table(f"{args.tensor}  {t.dtype}{list(t.shape)}, {human(t.nbytes)}, {len(rows)} chunk(s)")
        for col in ("chunk", "rank", "offsets", "sizes", "flat", "file", "offset", "bytes"):
            table.add_column(col, justify="right" if col in ("chunk", "rank", "offset", "bytes") else "left", overflow="fold")
        for r in rows:
            table.add_row(str(r["chunk"]), str(r["rank"]), str(r["offsets"]), str(r["sizes"]),
                          "-" if r["flat"] is None else str(r["flat"]), r["file"], str(r["offset"]), human(r["nbytes"]))
        console().print(table)
        return 0
    import fnmatch

    names = sorted(m.tensors)
    if args.keys:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, k) for k in args.keys)]
    refs = describe_references(m)
    if args.json:
        dump({
            "references": refs,
            "format_version": m.format_version,
            "save_id": m.save_id,
            "world_size": m.world_size,
            "total_bytes": m.total_bytes,
            "layout": m.layout,
            "tensors": {
                k: {"dtype": m.tensors[k].dtype, "shape": list(m.tensors[k].shape), "chunks": len(m.tensors[k].chunks),
                    "bytes": m.tensors[k].nbytes, "ranks": sorted({c.rank for c in m.tensors[k].chunks})}
                for k in names
            },
        })
        return 0
    if args.plot:
        return 0
    table = new_table(f"{args.path}  (format v{m.format_version}, saved by {m.world_size} rank(s))")
    for col in ("tensor", "dtype", "shape", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left", overflow="fold")
    for k in names:
        t = m.tensors[k]
        table.add_row(k, t.dtype, str(list(t.shape)), str(len(t.chunks)), human(t.nbytes))
    con = console()
    con.print(table)
    con.print(f"{len(m.tensors)} tensors, {human(m.total_bytes)} in {len(m.files)} data file(s); "
              f"values: {', '.join(sorted(m.values)) or '-'}")
    con.print(f"save-time layout: {json.dumps(m.layout.get('entries', {}))}")
    if "offline_layout" in m.layout:
        con.print(f"pre-sharded for: {m.layout['offline_layout']}")
    for r in refs:  # an incremental checkpoint: what it reads from other checkpoints
        con.print(f"references {r['files']} data file(s), {human(r['bytes'])}, in {r['base']} (outside this folder)")
    return 0


def add_inspect(sub) -> None:
    """The ``inspect`` subcommand."""
    pi = add_command(sub, "inspect", "list the tensors of a checkpoint, one tensor's chunks, or draw a shard map", (
        "  shardpoint inspect ckpt/step_100\n"
        "  shardpoint inspect ckpt/step_100 --json | jq .total_bytes\n"
        "  shardpoint inspect ckpt/step_100 --tensor model.layers.0.attn.wq.weight\n"
        "  shardpoint inspect ckpt/step_100 --plot shards.png --keys 'model.layers.0.*'"))
    pi.add_argument("path")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.add_argument("--tensor", metavar="NAME", help="show the chunks of one tensor and the rank that wrote each")
    pi.add_argument("--plot", metavar="OUT.png", help="draw a shard map (needs matplotlib)")
    pi.add_argument("--keys", action="append", default=[], metavar="GLOB", help="only tensors matching (repeatable)")
    pi.add_argument("--max-tensors", type=int, default=48, help="at most this many panels in --plot (largest first)")
    pi.set_defaults(fn=run_inspect)


def run_verify(args) -> int:
    """Check every chunk's checksum; 1 when anything is damaged."""
    n, problems = verify_checkpoint(args.path, args.jobs, args.quiet or args.no_progress)
    if args.json:
        dump({"path": args.path, "chunks": n, "ok": not problems, "problems": problems})
        return 1 if problems else 0
    if problems:
        for p in problems:
            print(f"CORRUPT: {p}")
        print(f"{len(problems)} problem(s) in {args.path}")
        return 1
    if not args.quiet:
        m = read_manifest(args.path)
        print(f"OK: {n} chunks in {len(m.tensors)} tensors verified ({human(m.total_bytes)})")
    return 0


def add_verify(sub) -> None:
    """The ``verify`` subcommand."""
    pv = add_command(sub, "verify", "check completeness and every chunk's checksum, in parallel", (
        "  shardpoint verify ckpt/step_100 && echo intact\n"
        "  shardpoint verify ckpt/step_100 --jobs 16 --json"))
    pv.add_argument("path")
    pv.add_argument("--jobs", type=int, default=4, help="parallel readers")
    pv.add_argument("--json", action="store_true", help="machine-readable output")
    add_quiet(pv)
    pv.set_defaults(fn=run_verify)


def run_diff(args) -> int:
    """Compare two checkpoints; 1 when they differ."""
    from ..convert import diff

    d = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys, values=not args.no_values,
             quiet=args.quiet or args.no_progress)
    if args.json:
        dump(d.to_json())
        return 0 if d.same else 1
    if d.same:
        if not args.quiet:
            print(f"same: {d.compared} tensors equal within atol={args.atol} rtol={args.rtol}")
        return 0
    con = console()
    if d.changed:
        table = new_table(f"{len(d.changed)} of {d.compared} tensors differ (atol={args.atol}, rtol={args.rtol})")
        for col in ("tensor", "dtype", "shape", "differing", "max abs diff", "max rel diff"):
            table.add_column(col, justify="left" if col in ("tensor", "dtype", "shape") else "right", overflow="fold")
        for t in d.changed:
            what = f"{t.n_diff}/{t.numel}" if t.reason == "values" else f"{t.reason}; {t.n_diff}/{t.numel}"
            table.add_row(t.name, t.dtype, str(t.shape), what, f"{t.max_abs:.3g}", f"{t.max_rel:.3g}")
        con.print(table)
    for label, items in (("only in A", d.only_a), ("only in B", d.only_b), ("values differ", d.values_changed),
                         ("values only in A", d.values_only_a), ("values only in B", d.values_only_b)):
        if items:
            con.print(f"{label} ({len(items)}): {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}")
    return 1


def add_diff(sub) -> None:
    """The ``diff`` subcommand."""
    pd = add_command(sub, "diff", "which tensors differ between two checkpoints, and by how much (exit 1 if any)", (
        "  shardpoint diff ckpt/step_100 resumed/step_100\n"
        "  shardpoint diff a b --atol 1e-6 --rtol 1e-5 --keys 'model.*' --json\n"
        "A tensor differs where |a - b| > atol + rtol * |b| (NaNs in the same places are equal)."))
    pd.add_argument("a")
    pd.add_argument("b")
    pd.add_argument("--atol", type=float, default=0.0)
    pd.add_argument("--rtol", type=float, default=0.0)
    pd.add_argument("--keys", action="append", default=[], metavar="GLOB", help="only tensors matching (repeatable)")
    pd.add_argument("--no-values", action="store_true", help="compare tensors only, not plain values")
    pd.add_argument("--json", action="store_true")
    add_quiet(pd)
    pd.set_defaults(fn=run_diff)


def run_trace(args) -> int:
    """Print a trace folder's slowest phases and ranks (and merge it into one timeline)."""
    from ..runtime.monitor import merge_traces, trace_report

    if args.merge:
        merge_traces(args.dir, args.merge)
    print(trace_report(args.dir, args.top))
    return 0


def add_trace(sub) -> None:
    """The ``trace`` subcommand."""
    pt = add_command(sub, "trace", "print the slowest phases and ranks of a trace folder (save/load trace_dir=...)", (
        "  shardpoint trace traces/step_100\n"
        "  shardpoint trace traces/step_100 --merge timeline.json   # open in Perfetto"))
    pt.add_argument("dir")
    pt.add_argument("--top", type=int, default=10)
    pt.add_argument("--merge", metavar="OUT.json", help="also write all ranks as one Chrome trace")
    pt.set_defaults(fn=run_trace)
