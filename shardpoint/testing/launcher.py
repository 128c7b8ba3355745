"""Run a function on several gloo ranks as real processes, and corrupt a byte on purpose.

:func:`launch` starts one launcher process (``python -m shardpoint.testing``)
that forks the ranks, bound to 127.0.0.1: forking from one process that has
imported torch once is many times cheaper than spawning each rank.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from typing import Any

import torch

__all__ = ["LaunchError", "launch", "launcher_main", "flip_byte"]

STDERR_TAIL = 24000  # enough for every thread's stack of two hung ranks, as the hang dump prints them


class LaunchError(RuntimeError):
    """A launched rank failed; the message carries every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, target: str, args: dict, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import faulthandler

    # A crash (SIGSEGV, SIGBUS) leaves every thread's stack in the launch's folder, for the error.
    crash = open(os.path.join(outdir, f"rank{rank}.crash"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(crash, all_threads=True)
    hang = float(os.environ.get("SHARDPOINT_HANG_DUMP_S", "0"))
    if hang > 0:  # print every thread's stack if this rank is still running then
        faulthandler.dump_traceback_later(hang, exit=True)
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mod, fn = target.split(":")
        value = getattr(importlib.import_module(mod), fn)(rank, world, **args)
        result = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def launcher_main(argv: list[str]) -> None:
    """The launcher process (``python -m shardpoint.testing TARGET WORLD ARGS_FILE OUTDIR``): fork the ranks, wait."""
    target, world, args_file, outdir = argv[0], int(argv[1]), argv[2], argv[3]
    with open(args_file) as f:
        args = json.load(f)
    import torch.multiprocessing as mp

    # Import once here, not in every forked rank: the first optimizer imports torch._dynamo,
    # which takes seconds per process when all ranks do it at once on a small machine.
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from ..runtime.torchcompat import enable_cpu_fsdp2

    enable_cpu_fsdp2()  # FSDP2 on CPU with torch 2.6; the forked ranks inherit it
    port = _free_port()
    mp.start_processes(_rank_entry, args=(world, port, target, args, outdir), nprocs=world, start_method="fork", join=True)


def flip_byte(path: str, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at ``offset`` of the file ``path`` with ``mask``: the smallest corruption a checksum must catch.

    Example::

        chunk = sp.read_manifest(ck).tensors["w"].chunks[0]
        flip_byte(os.path.join(ck, chunk.file), chunk.offset + 7)
    """
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def launch(world: int, target: str, args: dict | None = None, timeout: float = 300) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world`` gloo ranks; return each rank's value.

    The function is called as ``fn(rank, world, **args)`` after the process
    group is up, and must return JSON-serialisable data.
    """
    with tempfile.TemporaryDirectory() as d:
        args_file = os.path.join(d, "args.json")
        with open(args_file, "w") as f:
            json.dump(args or {}, f)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("SHARDPOINT_HANG_DUMP_S", str(max(1.0, timeout - 15)))
        cwd = os.getcwd()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "shardpoint.testing", target, str(world), args_file, d],
                env=env, capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise LaunchError(f"{target} on {world} ranks timed out after {timeout}s\n{err[-6000:]}") from None
        results, failures = [], []
        for r in range(world):
            p = os.path.join(d, f"rank{r}.json")
            if not os.path.exists(p):
                crash = os.path.join(d, f"rank{r}.crash")
                dump = open(crash).read()[-4000:] if os.path.exists(crash) else ""
                failures.append(f"rank {r}: no result (crashed?)" + (f"\n{dump}" if dump.strip() else ""))
                results.append(None)
                continue
            with open(p) as f:
                res = json.load(f)
            if res["ok"]:
                results.append(res["value"])
            else:
                failures.append(f"rank {r}:\n{res['error']}")
                results.append(None)
        if failures:
            raise LaunchError(
                f"{target} on {world} ranks failed (exit {proc.returncode}):\n" + "\n".join(failures)
                + f"\n--- stderr tail ---\n{proc.stderr[-STDERR_TAIL:]}"
            )
        return results

