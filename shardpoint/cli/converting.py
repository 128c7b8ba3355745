"""The subcommands that write: consolidate, export, import and reshard.

Outputs to a local path are written under a temporary name beside it and
moved into place only on success (:func:`staged`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid

from ..convert.consolidate import consolidate_arguments
from ..errors import ConversionError
from .common import add_command, add_naming, add_quiet, human

__all__ = ["add_consolidate", "add_export", "add_import", "add_reshard", "run_export", "run_import", "run_reshard", "staged"]


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


@contextlib.contextmanager
def staged(out: str, force: bool, folder: bool = True):
    """Yield a temporary path next to ``out``; on success move it into place, on failure remove it.

    A folder output with ``force`` keeps ``out``'s other files (the entries
    written replace theirs), as writing into it directly would.
    Remote outputs (``s3://``...) are written in place: their commit is the
    manifest, written last.
    """
    if not _is_local(out):
        yield out
        return
    out = out[len("file://"):] if out.startswith("file://") else out
    if os.path.exists(out) and not force:
        if not folder:
            raise ConversionError(f"{out} exists; pass --force to replace it")
        if not os.path.isdir(out):
            raise ConversionError(f"{out} exists and is not a folder")
        if os.listdir(out):
            raise ConversionError(f"{out} exists and is not empty; pass --force to write into it")
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.partial-{uuid.uuid4().hex[:12]}")
    try:
        yield tmp
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    if not folder or not os.path.isdir(out):
        if folder and os.path.lexists(out):
            os.rmdir(out)  # an empty folder (checked above)
        os.replace(tmp, out)
        return
    for entry in os.listdir(tmp):  # --force into an existing folder
        dst = os.path.join(out, entry)
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(os.path.join(tmp, entry), dst)
    os.rmdir(tmp)


_DEFAULT_PREFIX = {"hf": "model.", "torch": "model.", "dcp": "", "deepspeed": ""}


def run_export(args) -> int:
    """Write a checkpoint's tensors as safetensors, a DCP folder or a torch.save file."""
    from ..convert import export_dcp, export_hf, export_torch
    from ..convert.options import parse_dtype
    from ..convert.hf import HF_CONFIG_KEY

    dtype = parse_dtype(args.dtype)
    prefix = _DEFAULT_PREFIX[args.to] if args.prefix is None else args.prefix
    kw = dict(prefix=prefix, rename=args.rename, keys=args.keys, exclude=args.exclude, dtype=dtype, force=args.force,
              quiet=args.quiet or args.no_progress, verify=not args.no_verify)
    if args.to != "hf" and (args.config or args.shard_size != "5GB" or args.config_key != HF_CONFIG_KEY):
        raise ConversionError("--config, --config-key and --shard-size apply to --to hf only")
    with staged(args.out, args.force, folder=args.to != "torch") as out:
        if out != args.out:
            kw["force"] = True  # the staging folder is new; the real output was checked above
        if args.to == "hf":
            r = export_hf(args.path, out, shard_size=args.shard_size, config=args.config, config_key=args.config_key, **kw)
        else:
            r = (export_dcp if args.to == "dcp" else export_torch)(args.path, out, **kw)
    if args.to == "hf":
        files = ", ".join(r.files) if len(r.files) <= 3 else f"{r.files[0]} ... {r.files[-1]}"
        summary = f"exported {r.tensors} tensors ({human(r.bytes)}) to {args.out}: {files} + model.safetensors.index.json"
        summary += (f" + config.json (from {r.config})" if r.config else
                    f"; no config.json: pass --config, or save the model config as the value {args.config_key}")
    else:
        summary = f"exported {r.tensors} tensors ({human(r.bytes)}) to {args.out} ({args.to})"
    if not args.quiet:
        print(summary)
    return 0


def run_import(args) -> int:
    """Make a checkpoint from safetensors, a DCP folder, a torch.save file or a DeepSpeed folder."""
    from ..convert import import_dcp, import_hf, import_torch
    from ..convert.options import parse_dtype

    dtype = parse_dtype(args.dtype)
    prefix = _DEFAULT_PREFIX[args.fmt] if args.prefix is None else args.prefix
    kw = dict(prefix=prefix, rename=args.rename, keys=args.keys, exclude=args.exclude, dtype=dtype,
              block_size=args.block_size, force=args.force, quiet=args.quiet or args.no_progress)
    if args.trust_pickle:
        print("warning: --trust-pickle is deprecated and goes away in the next release; use --allow-pickle",
              file=sys.stderr)
    allow = args.allow_pickle or args.trust_pickle
    with staged(args.path, args.force) as path:
        force = True if path != args.path else args.force
        kw["force"] = force
        if args.fmt == "deepspeed":
            from ..convert.deepspeed_native import import_deepspeed

            r = import_deepspeed(args.src, path, allow_pickle=allow, block_size=args.block_size, force=force)
        elif args.fmt == "hf":
            r = import_hf(args.src, path, **kw)
        elif args.fmt == "dcp":
            r = import_dcp(args.src, path, allow_pickle=allow, **kw)
        else:
            r = import_torch(args.src, path, allow_pickle=allow, **kw)
    if not args.quiet:
        print(f"imported {r.tensors} tensors ({human(r.bytes)}) from {args.src} into {args.path}")
        if r.skipped:
            print(f"skipped {len(r.skipped)}: {', '.join(r.skipped[:10])}{' ...' if len(r.skipped) > 10 else ''}")
    return 0


def run_reshard(args) -> int:
    """Write a copy pre-sharded for a target layout."""
    from ..convert import reshard

    with staged(args.out, args.force) as out:
        r = reshard(args.path, out, args.to_layout, tp_rules=args.tp_rule, block_size=args.block_size,
                    force=True if out != args.out else args.force, quiet=args.quiet or args.no_progress,
                    verify=not args.no_verify)
    if not args.quiet:
        spread = ", ".join(f"r{k}={human(v)}" for k, v in list(r.per_rank_bytes.items())[:16])
        print(f"wrote {r.chunks} chunks ({human(r.bytes)}) for {r.spec} ({r.world} ranks) to {args.out}: {spread}"
              f"{' ...' if r.world > 16 else ''}")
    return 0


def add_consolidate(sub) -> None:
    """The ``consolidate`` subcommand."""
    pc = add_command(sub, "consolidate", "copy a checkpoint with every data file it references: a self-contained copy", (
        "  shardpoint consolidate run/step_00000900 archive/step_900"))
    consolidate_arguments(pc)


def add_export(sub) -> None:
    """The ``export`` subcommand."""
    pe = add_command(sub, "export", "write a checkpoint's tensors as Hugging Face safetensors, a DCP folder or a torch.save file", (
        "  shardpoint export ckpt/step_100 --to hf hf_out --dtype bf16 --shard-size 5GB --config config.json\n"
        "  shardpoint export ckpt/step_100 --to hf hf_out   # config.json from the saved value extra.hf_config\n"
        "  shardpoint export ckpt/step_100 --to hf hf_out --rename '^tok\\.=embed_tokens.'\n"
        "  shardpoint export ckpt/step_100 --to dcp dcp_out\n"
        "  shardpoint export ckpt/step_100 --to torch model.pt   # {name: tensor} without the 'model.' prefix\n"
        "Tensors are streamed one at a time: memory stays near the largest tensor."))
    pe.add_argument("path")
    pe.add_argument("--to", required=True, choices=("hf", "dcp", "torch"))
    pe.add_argument("out", help="output folder (hf, dcp) or file (torch)")
    pe.add_argument("--shard-size", default="5GB", help="hf: largest safetensors file (5GB, 500MB, 2GiB)")
    pe.add_argument("--config", metavar="config.json", help="hf: write this config.json into the output folder "
                    "(default: the config the checkpoint carries, if any)")
    pe.add_argument("--config-key", default="extra.hf_config", metavar="KEY",
                    help="hf: the saved value that carries the model config dict (default: extra.hf_config)")
    pe.add_argument("--no-verify", action="store_true", help="skip checksum verification of what is read")
    add_naming(pe, "stripped from exported names; default 'model.' for hf and torch, '' for dcp")
    pe.set_defaults(fn=run_export)


def add_import(sub) -> None:
    """The ``import`` subcommand."""
    pm = add_command(sub, "import", "make a shardpoint checkpoint from safetensors, a DCP folder or a torch.save file", (
        "  shardpoint import hf path/to/hf_model ckpt/pretrained     # folder, index json or one .safetensors\n"
        "  shardpoint import dcp dcp_ckpt ckpt/from_dcp --allow-pickle\n"
        "  shardpoint import torch model.pt ckpt/from_pt --allow-pickle\n"
        "then: sp.load('ckpt/pretrained', {'model': fsdp_model})\n\n"
        "--allow-pickle: DCP's .metadata file and a torch.save file are Python pickles, and\n"
        "unpickling runs whatever code the file's author put in it. Only import files you\n"
        "trust; safetensors (hf) holds no code and needs no flag."))
    pm.add_argument("fmt", choices=("hf", "dcp", "torch", "deepspeed"), metavar="{hf,dcp,torch,deepspeed}")
    pm.add_argument("src", metavar="IN")
    pm.add_argument("path", metavar="PATH", help="the new checkpoint")
    pm.add_argument("--allow-pickle", action="store_true",
                    help="allow unpickling (dcp, torch, deepspeed): it can run arbitrary code, so only for trusted files")
    pm.add_argument("--trust-pickle", action="store_true", help=argparse.SUPPRESS)  # deprecated spelling
    pm.add_argument("--block-size", type=int, default=4 << 20, help="checksum block size in bytes")
    add_naming(pm, "prepended to imported names; default 'model.' for hf and torch, '' for dcp")
    pm.set_defaults(fn=run_import)


def add_reshard(sub) -> None:
    """The ``reshard`` subcommand."""
    pr = add_command(sub, "reshard", "write a copy pre-sharded for a target layout (offline, no process group)", (
        "  shardpoint reshard ckpt/step_100 --to-layout fsdp:8 ckpt/fsdp8\n"
        "  shardpoint reshard ckpt/step_100 --to-layout tp:2 --tp-rule '*.wo.weight=1' --tp-rule '*.w2.weight=1' ckpt/tp2\n"
        "  shardpoint reshard ckpt/step_100 --to-layout tp:2,fsdp:4 ckpt/2d\n"
        "Layout: comma-separated KIND:N parts, splitting left to right with torch.chunk sizes:\n"
        "  fsdp:N  dim 0 over N ranks      tp:N  dim from --tp-rule (default: dim 0 of 2-D+ tensors)\n"
        "  dp:N    N replicas (written once)    single  one chunk per tensor"))
    pr.add_argument("path")
    pr.add_argument("--to-layout", required=True, metavar="SPEC")
    pr.add_argument("out")
    pr.add_argument("--tp-rule", action="append", default=[], metavar="GLOB=DIM",
                    help="TP split dim for matching tensors (or GLOB=replicate); first match wins")
    pr.add_argument("--block-size", type=int, default=None, help="checksum block size (default: the source's)")
    pr.add_argument("--no-verify", action="store_true")
    pr.add_argument("--force", action="store_true")
    add_quiet(pr)
    pr.set_defaults(fn=run_reshard)
