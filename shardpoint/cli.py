"""The ``shardpoint`` command: inspect, verify, convert, reshard and compare checkpoints.

Run it as ``shardpoint ...`` or ``python -m shardpoint ...``; :data:`HELP` is
its plain-text help. Example::

    main(["verify", "ckpt/step_100"])  # 0 when intact
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import uuid

from .api import read_manifest
from .errors import CheckpointError, ConversionError
from .runtime.extras import require
from .convert.verify import verify_checkpoint
from .convert.consolidate import consolidate_arguments, describe_references

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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _console():
    return require("rich.console", "cli", "the shardpoint command's tables").Console(highlight=False)


def _table(title: str):
    return require("rich.table", "cli", "the shardpoint command's tables").Table(title=title)


def _dump(doc) -> None:
    json.dump(doc, sys.stdout, indent=1, default=str)
    print()


# ------------------------------------------------------------------ inspect
def _inspect(args) -> int:
    from .convert.shardmap import chunk_table, plot_shard_map

    m = read_manifest(args.path)
    if args.plot:
        n = plot_shard_map(m, args.plot, keys=args.keys, max_tensors=args.max_tensors)
        if not args.json and not args.tensor:
            print(f"wrote a shard map of {n} tensor(s) to {args.plot}", file=sys.stderr)
    if args.tensor:
        rows = chunk_table(m, args.tensor)
        t = m.tensors[args.tensor]
        if args.json:
            _dump({"tensor": args.tensor, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": rows})
            return 0
        table = _table(f"{args.tensor}  {t.dtype}{list(t.shape)}, {_human(t.nbytes)}, {len(rows)} chunk(s)")
        for col in ("chunk", "rank", "offsets", "sizes", "flat", "file", "offset", "bytes"):
            table.add_column(col, justify="right" if col in ("chunk", "rank", "offset", "bytes") else "left", overflow="fold")
        for r in rows:
            table.add_row(str(r["chunk"]), str(r["rank"]), str(r["offsets"]), str(r["sizes"]),
                          "-" if r["flat"] is None else str(r["flat"]), r["file"], str(r["offset"]), _human(r["nbytes"]))
        _console().print(table)
        return 0
    import fnmatch

    names = sorted(m.tensors)
    if args.keys:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, k) for k in args.keys)]
    refs = describe_references(m)
    if args.json:
        _dump({
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
    table = _table(f"{args.path}  (format v{m.format_version}, saved by {m.world_size} rank(s))")
    for col in ("tensor", "dtype", "shape", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left", overflow="fold")
    for k in names:
        t = m.tensors[k]
        table.add_row(k, t.dtype, str(list(t.shape)), str(len(t.chunks)), _human(t.nbytes))
    con = _console()
    con.print(table)
    con.print(f"{len(m.tensors)} tensors, {_human(m.total_bytes)} in {len(m.files)} data file(s); "
              f"values: {', '.join(sorted(m.values)) or '-'}")
    con.print(f"save-time layout: {json.dumps(m.layout.get('entries', {}))}")
    if "offline_layout" in m.layout:
        con.print(f"pre-sharded for: {m.layout['offline_layout']}")
    for r in refs:  # an incremental checkpoint: what it reads from other checkpoints
        con.print(f"references {r['files']} data file(s), {_human(r['bytes'])}, in {r['base']} (outside this folder)")
    return 0


# ------------------------------------------------------------------ verify
def _verify(args) -> int:
    n, problems = verify_checkpoint(args.path, args.jobs, args.quiet or args.no_progress)
    if args.json:
        _dump({"path": args.path, "chunks": n, "ok": not problems, "problems": problems})
        return 1 if problems else 0
    if problems:
        for p in problems:
            print(f"CORRUPT: {p}")
        print(f"{len(problems)} problem(s) in {args.path}")
        return 1
    if not args.quiet:
        m = read_manifest(args.path)
        print(f"OK: {n} chunks in {len(m.tensors)} tensors verified ({_human(m.total_bytes)})")
    return 0


# ------------------------------------------------------------------ export / import
def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


@contextlib.contextmanager
def _staged(out: str, force: bool, folder: bool = True):
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


def _export(args) -> int:
    from .convert import export_dcp, export_hf, export_torch
    from .convert.options import parse_dtype
    from .convert.hf import HF_CONFIG_KEY

    dtype = parse_dtype(args.dtype)
    prefix = _DEFAULT_PREFIX[args.to] if args.prefix is None else args.prefix
    kw = dict(prefix=prefix, rename=args.rename, keys=args.keys, exclude=args.exclude, dtype=dtype, force=args.force,
              quiet=args.quiet or args.no_progress, verify=not args.no_verify)
    if args.to != "hf" and (args.config or args.shard_size != "5GB" or args.config_key != HF_CONFIG_KEY):
        raise ConversionError("--config, --config-key and --shard-size apply to --to hf only")
    with _staged(args.out, args.force, folder=args.to != "torch") as out:
        if out != args.out:
            kw["force"] = True  # the staging folder is new; the real output was checked above
        if args.to == "hf":
            r = export_hf(args.path, out, shard_size=args.shard_size, config=args.config, config_key=args.config_key, **kw)
        else:
            r = (export_dcp if args.to == "dcp" else export_torch)(args.path, out, **kw)
    if args.to == "hf":
        files = ", ".join(r.files) if len(r.files) <= 3 else f"{r.files[0]} ... {r.files[-1]}"
        summary = f"exported {r.tensors} tensors ({_human(r.bytes)}) to {args.out}: {files} + model.safetensors.index.json"
        summary += (f" + config.json (from {r.config})" if r.config else
                    f"; no config.json: pass --config, or save the model config as the value {args.config_key}")
    else:
        summary = f"exported {r.tensors} tensors ({_human(r.bytes)}) to {args.out} ({args.to})"
    if not args.quiet:
        print(summary)
    return 0


def _import(args) -> int:
    from .convert import import_dcp, import_hf, import_torch
    from .convert.options import parse_dtype

    dtype = parse_dtype(args.dtype)
    prefix = _DEFAULT_PREFIX[args.fmt] if args.prefix is None else args.prefix
    kw = dict(prefix=prefix, rename=args.rename, keys=args.keys, exclude=args.exclude, dtype=dtype,
              block_size=args.block_size, force=args.force, quiet=args.quiet or args.no_progress)
    if args.trust_pickle:
        print("warning: --trust-pickle is deprecated and goes away in the next release; use --allow-pickle",
              file=sys.stderr)
    allow = args.allow_pickle or args.trust_pickle
    with _staged(args.path, args.force) as path:
        force = True if path != args.path else args.force
        kw["force"] = force
        if args.fmt == "deepspeed":
            from .convert.deepspeed_native import import_deepspeed

            r = import_deepspeed(args.src, path, allow_pickle=allow, block_size=args.block_size, force=force)
        elif args.fmt == "hf":
            r = import_hf(args.src, path, **kw)
        elif args.fmt == "dcp":
            r = import_dcp(args.src, path, allow_pickle=allow, **kw)
        else:
            r = import_torch(args.src, path, allow_pickle=allow, **kw)
    if not args.quiet:
        print(f"imported {r.tensors} tensors ({_human(r.bytes)}) from {args.src} into {args.path}")
        if r.skipped:
            print(f"skipped {len(r.skipped)}: {', '.join(r.skipped[:10])}{' ...' if len(r.skipped) > 10 else ''}")
    return 0


# ------------------------------------------------------------------ reshard / diff / trace
def _reshard(args) -> int:
    from .convert import reshard

    with _staged(args.out, args.force) as out:
        r = reshard(args.path, out, args.to_layout, tp_rules=args.tp_rule, block_size=args.block_size,
                    force=True if out != args.out else args.force, quiet=args.quiet or args.no_progress,
                    verify=not args.no_verify)
    if not args.quiet:
        spread = ", ".join(f"r{k}={_human(v)}" for k, v in list(r.per_rank_bytes.items())[:16])
        print(f"wrote {r.chunks} chunks ({_human(r.bytes)}) for {r.spec} ({r.world} ranks) to {args.out}: {spread}"
              f"{' ...' if r.world > 16 else ''}")
    return 0


def _diff(args) -> int:
    from .convert import diff

    d = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys, values=not args.no_values,
             quiet=args.quiet or args.no_progress)
    if args.json:
        _dump(d.to_json())
        return 0 if d.same else 1
    if d.same:
        if not args.quiet:
            print(f"same: {d.compared} tensors equal within atol={args.atol} rtol={args.rtol}")
        return 0
    con = _console()
    if d.changed:
        table = _table(f"{len(d.changed)} of {d.compared} tensors differ (atol={args.atol}, rtol={args.rtol})")
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


def _trace(args) -> int:
    from .runtime.monitor import merge_traces, trace_report

    if args.merge:
        merge_traces(args.dir, args.merge)
    print(trace_report(args.dir, args.top))
    return 0


# ------------------------------------------------------------------ parser
def _cmd(sub, name: str, help: str, examples: str):
    return sub.add_parser(name, help=help, description=f"{help}\n\nExamples:\n{examples}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _naming(p, default_note: str) -> None:
    p.add_argument("--prefix", default=None, help=f"name prefix of the model's state key ({default_note})")
    p.add_argument("--rename", action="append", default=[], metavar="REGEX=REPL",
                   help="regex substitution on tensor names, repeatable, applied in order")
    p.add_argument("--keys", action="append", default=[], metavar="GLOB", help="only tensors whose name matches (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip tensors whose name matches (repeatable)")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16, fp16, fp32 (default: keep)")
    p.add_argument("--force", action="store_true", help="write into an existing, non-empty output")
    _quiet(p)


def _quiet(p) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line stays)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardpoint`` command.

    Example::

        build_parser().parse_args(["verify", "ckpt/step_100"]).jobs  # 4
    """
    p = argparse.ArgumentParser(prog="shardpoint", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    pi = _cmd(sub, "inspect", "list the tensors of a checkpoint, one tensor's chunks, or draw a shard map", (
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
    pi.set_defaults(fn=_inspect)
    pc = _cmd(sub, "consolidate", "copy a checkpoint with every data file it references: a self-contained copy", (
        "  shardpoint consolidate run/step_00000900 archive/step_900"))
    consolidate_arguments(pc)

    pv = _cmd(sub, "verify", "check completeness and every chunk's checksum, in parallel", (
        "  shardpoint verify ckpt/step_100 && echo intact\n"
        "  shardpoint verify ckpt/step_100 --jobs 16 --json"))
    pv.add_argument("path")
    pv.add_argument("--jobs", type=int, default=4, help="parallel readers")
    pv.add_argument("--json", action="store_true", help="machine-readable output")
    _quiet(pv)
    pv.set_defaults(fn=_verify)

    pe = _cmd(sub, "export", "write a checkpoint's tensors as Hugging Face safetensors, a DCP folder or a torch.save file", (
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
    _naming(pe, "stripped from exported names; default 'model.' for hf and torch, '' for dcp")
    pe.set_defaults(fn=_export)

    pm = _cmd(sub, "import", "make a shardpoint checkpoint from safetensors, a DCP folder or a torch.save file", (
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
    _naming(pm, "prepended to imported names; default 'model.' for hf and torch, '' for dcp")
    pm.set_defaults(fn=_import)

    pr = _cmd(sub, "reshard", "write a copy pre-sharded for a target layout (offline, no process group)", (
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
    _quiet(pr)
    pr.set_defaults(fn=_reshard)

    pd = _cmd(sub, "diff", "which tensors differ between two checkpoints, and by how much (exit 1 if any)", (
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
    _quiet(pd)
    pd.set_defaults(fn=_diff)

    pt = _cmd(sub, "trace", "print the slowest phases and ranks of a trace folder (save/load trace_dir=...)", (
        "  shardpoint trace traces/step_100\n"
        "  shardpoint trace traces/step_100 --merge timeline.json   # open in Perfetto"))
    pt.add_argument("dir")
    pt.add_argument("--top", type=int, default=10)
    pt.add_argument("--merge", metavar="OUT.json", help="also write all ranks as one Chrome trace")
    pt.set_defaults(fn=_trace)
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


if __name__ == "__main__":
    sys.exit(main())
