"""The ``shardpoint`` command: inspect, verify, convert, reshard and compare checkpoints.

Run it as ``shardpoint ...`` or ``python -m shardpoint ...``; :data:`HELP` is
its plain-text help. Example::

    main(["verify", "ckpt/step_100"])  # 0 when intact
"""

from __future__ import annotations

import argparse
import sys

from ..errors import CheckpointError
from .converting import add_consolidate, add_export, add_import, add_reshard
from .reading import add_diff, add_inspect, add_trace, add_verify

__all__ = ["main", "build_parser", "HELP"]

HELP = """\
Inspect, verify, convert, reshard and compare shardpoint checkpoints.

Commands (each has --help with examples):
  shardpoint inspect ckpt/step_100                     # table of tensors, totals, layout
  shardpoint inspect ckpt/step_100 --tensor model.tok.weight   # its chunks and writers
  shardpoint inspect ckpt/step_100 --plot shards.png   # shard map picture
  shardpoint verify ckpt/step_100                      # every checksum, in parallel
  shardpoint consolidate run/step_00000900 archive/step_900   # self-contained copy of an incremental checkpoint
  shardpoint export ckpt/step_100 --to hf hf_out --dtype bf16 --config config.json
  shardpoint export ckpt/step_100 --to dcp dcp_out
  shardpoint export ckpt/step_100 --to torch model.pt
  shardpoint import hf hf_model_dir ckpt/pretrained
  shardpoint import dcp dcp_ckpt ckpt/from_dcp --allow-pickle
  shardpoint import torch model.pt ckpt/from_pt --allow-pickle
  shardpoint import deepspeed ds_ckpt ckpt/from_ds --allow-pickle   # engine.save_checkpoint folders (ZeRO 1-3)
  shardpoint reshard ckpt/step_100 --to-layout fsdp:8 ckpt/step_100-fsdp8
  shardpoint diff ckpt/step_100 resumed/step_100 --atol 1e-6
  shardpoint trace traces/step_100                     # slowest phases and ranks

Long commands show a progress bar on stderr; --no-progress turns it off,
--quiet (-q) turns off the bar and the summary line.

Exit status:
  0  success
  1  verify found damage (a missing, truncated, unsafe or corrupt data file or
     chunk), or diff found a difference
  2  any error: bad arguments, or a checkpoint that cannot be read (missing,
     malformed or unsafe metadata); one line on stderr names the problem

Outputs of export, import and reshard to a local path are written under a
temporary name next to it and renamed into place only on success; a failed
run leaves nothing behind.
"""
"""The command's ``--help`` text: plain text, no markup."""

# The subcommands, in the order ``--help`` lists them.
COMMANDS = (add_inspect, add_consolidate, add_verify, add_export, add_import, add_reshard, add_diff, add_trace)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardpoint`` command.

    Example::

        build_parser().parse_args(["verify", "ckpt/step_100"]).jobs  # 4
    """
    p = argparse.ArgumentParser(prog="shardpoint", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``shardpoint`` command; returns the exit status.

    Example::

        sys.exit(main(["inspect", "ckpt/step_100", "--json"]))
    """
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - bad input of any kind: one line, exit 2, never a traceback
        _error_line(e)
        return 2
    except BaseException as e:  # e.g. a library's BaseException-derived error; never SystemExit's job
        if isinstance(e, SystemExit):
            raise
        _error_line(e)
        return 2


def _error_line(e: BaseException) -> None:
    kind = type(e).__name__ if isinstance(e, (CheckpointError, OSError, ValueError)) else f"unexpected {type(e).__name__}"
    text = " ".join(str(e).split()) or "(no message)"
    print(f"error: {kind}: {text[:2000]}", file=sys.stderr)
