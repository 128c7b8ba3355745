"""What the ``shardpoint`` command's subcommands share: sizes for people, tables, JSON, and common flags."""

from __future__ import annotations

import argparse
import json
import sys

from ..runtime.extras import require

__all__ = ["human", "console", "new_table", "dump", "add_command", "add_naming", "add_quiet"]


def human(n: float) -> str:
    """``n`` bytes for people: ``human(3 << 20)`` is ``'3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def console():
    """A rich console for the command's tables (the ``cli`` extra)."""
    return require("rich.console", "cli", "the shardpoint command's tables").Console(highlight=False)


def new_table(title: str):
    """A rich table titled ``title`` (the ``cli`` extra)."""
    return require("rich.table", "cli", "the shardpoint command's tables").Table(title=title)


def dump(doc) -> None:
    """Print ``doc`` as indented JSON on standard output."""
    json.dump(doc, sys.stdout, indent=1, default=str)
    print()


def add_command(sub, name: str, help: str, examples: str):
    """A subcommand's parser, whose ``--help`` ends with its ``examples``."""
    return sub.add_parser(name, help=help, description=f"{help}\n\nExamples:\n{examples}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_naming(p, default_note: str) -> None:
    """The flags that name, select and cast the tensors a conversion writes, and ``--force``."""
    p.add_argument("--prefix", default=None, help=f"name prefix of the model's state key ({default_note})")
    p.add_argument("--rename", action="append", default=[], metavar="REGEX=REPL",
                   help="regex substitution on tensor names, repeatable, applied in order")
    p.add_argument("--keys", action="append", default=[], metavar="GLOB", help="only tensors whose name matches (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip tensors whose name matches (repeatable)")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16, fp16, fp32 (default: keep)")
    p.add_argument("--force", action="store_true", help="write into an existing, non-empty output")
    add_quiet(p)


def add_quiet(p) -> None:
    """``--quiet`` and ``--no-progress``."""
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line stays)")
