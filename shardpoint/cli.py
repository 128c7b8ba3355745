"""The ``shardpoint`` command: inspect and verify checkpoints (more commands to come).

Examples::

    shardpoint inspect ckpt/step_100
    shardpoint inspect ckpt/step_100 --json
    shardpoint verify ckpt/step_100
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from .api import read_manifest
from .engine.io import verify_chunk
from .errors import CheckpointError
from .storage import storage_for

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _inspect(args) -> int:
    m = read_manifest(args.path)
    if args.json:
        doc = {
            "format_version": m.format_version,
            "save_id": m.save_id,
            "world_size": m.world_size,
            "total_bytes": m.total_bytes,
            "layout": m.layout,
            "tensors": {
                k: {"dtype": t.dtype, "shape": list(t.shape), "chunks": len(t.chunks), "bytes": t.nbytes}
                for k, t in sorted(m.tensors.items())
            },
        }
        json.dump(doc, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.path}  (format v{m.format_version}, saved by {m.world_size} rank(s))")
    for col in ("tensor", "dtype", "shape", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for k, t in sorted(m.tensors.items()):
        table.add_row(k, t.dtype, str(list(t.shape)), str(len(t.chunks)), _human(t.nbytes))
    con = Console()
    con.print(table)
    con.print(f"{len(m.tensors)} tensors, {_human(m.total_bytes)}; values: {', '.join(sorted(m.values)) or '-'}")
    con.print(f"save-time layout: {json.dumps(m.layout.get('entries', {}))}")
    return 0


def _verify(args) -> int:
    storage = storage_for(args.path)
    m = read_manifest(storage)
    problems: list[str] = []
    for name, size in m.files.items():
        try:
            real = storage.size(name)
        except FileNotFoundError:
            problems.append(f"missing data file {name}")
            continue
        if real < size:
            problems.append(f"data file {name} is truncated: {real} of {size} bytes")
    work = [(fqn, c) for fqn, t in m.tensors.items() for c in t.chunks]
    from tqdm import tqdm

    def check(item):
        fqn, c = item
        try:
            verify_chunk(storage, m, fqn, c)
            return None
        except (CheckpointError, OSError) as e:
            return str(e)

    with ThreadPoolExecutor(args.jobs) as pool:
        for err in tqdm(pool.map(check, work), total=len(work), disable=args.quiet, desc="verify", unit="chunk"):
            if err:
                problems.append(err)
    if problems:
        for p in problems:
            print(f"CORRUPT: {p}")
        print(f"{len(problems)} problem(s) in {args.path}")
        return 1
    if not args.quiet:
        print(f"OK: {len(work)} chunks in {len(m.tensors)} tensors verified ({_human(m.total_bytes)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="list the tensors of a checkpoint", description="Example: shardpoint inspect ckpt/step_100 --json")
    pi.add_argument("path")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.set_defaults(fn=_inspect)
    pv = sub.add_parser("verify", help="check completeness and every checksum", description="Example: shardpoint verify ckpt/step_100")
    pv.add_argument("path")
    pv.add_argument("--jobs", type=int, default=4, help="parallel readers")
    pv.add_argument("--quiet", action="store_true")
    pv.set_defaults(fn=_verify)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
