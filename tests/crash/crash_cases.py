"""Rank functions and a driver for the crash tests: train, save, die by SIGKILL at a chosen point.

Each launch first restores the newest complete checkpoint and checks it, bit
for bit, against the reference that rank 0 wrote (with safetensors, outside
shardpoint) *before* that step's save began. Then it trains on, saving every
``INTERVAL`` steps, until the injected fault kills one rank.

Fault points (``fault["phase"]``):

- manager phases (through the manager's ``fault_hook``): ``snapshot`` (just
  before the snapshot; with a delay the kill lands inside it or in the
  writes), ``write`` (the background save is running; the delay picks the
  point), ``committed`` (committed, lock not yet released), ``retention``
  (between the deletions of an old checkpoint, manifest first), ``compact``
  (incremental runs: at each step of moving referenced chunks, see
  :mod:`shardpoint.manager.compact`);
- storage phases (through :class:`FaultStorage`): ``data`` (inside a data
  file write), ``manifest`` (all data durable, manifest not yet written),
  ``commit`` (manifest written to its temporary file, not yet renamed),
  ``commit_done`` (manifest renamed, save not yet reported);
- ``anytime``: a timer started after the restore, so the kill lands anywhere
  in training or saving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from shardpoint.format.manifest import MANIFEST_NAME
from shardpoint.manager import CheckpointManager
from shardpoint.storage import LocalStorage
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=64, dim=32, heads=4, layers=2, seq=8)
INTERVAL = 2
STEPS_PER_LAUNCH = 8
KEEP_LAST = 2


class Fault:
    """Kill this process (SIGKILL) at the n-th time ``phase`` is reached, after ``delay`` seconds."""

    def __init__(self, spec: dict | None, rank: int, marker: str):
        self.spec = spec or {}
        self.rank, self.marker = rank, marker
        self.count = 0
        self.lock = threading.Lock()

    def active(self) -> bool:
        return bool(self.spec) and self.spec.get("rank", self.rank) == self.rank

    def __call__(self, phase: str, step=None, rank=None) -> None:
        if not self.active() or phase != self.spec["phase"]:
            return
        if self.spec.get("step") is not None and step is not None and step < self.spec["step"]:
            return
        with self.lock:
            self.count += 1
            if self.count != self.spec.get("nth", 1):
                return
        self.fire(float(self.spec.get("delay", 0.0)))

    def fire(self, delay: float) -> None:
        def kill():
            with open(self.marker, "w") as f:
                json.dump({**self.spec, "at": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)

        if delay > 0:
            threading.Timer(delay, kill).start()
        else:
            kill()


class FaultStorage(LocalStorage):
    """Local storage that reports data writes and each step of the manifest commit to a fault."""

    def __init__(self, root: str, fault: Fault):
        super().__init__(root)
        self.fault = fault

    def child(self, sub: str) -> "FaultStorage":
        c = FaultStorage(os.path.join(self.root, sub), self.fault)
        c.stats = self.stats
        return c

    def open_writer(self, name):
        w = super().open_writer(name)
        inner, fault = w.write, self.fault

        def write(data):
            mv = memoryview(data).cast("B")
            half = len(mv) // 2
            inner(mv[:half])
            fault("data")  # half of this block is on disk
            inner(mv[half:])

        w.write = write
        return w

    def put_atomic(self, name: str, data: bytes) -> None:
        if name != MANIFEST_NAME:
            return super().put_atomic(name, data)
        self.fault("manifest")
        d = self.root
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.fault("commit")
        os.replace(tmp, os.path.join(d, name))
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        self.fault("commit_done")


def _ref_path(refs: str, step: int) -> str:
    return os.path.join(refs, f"step_{step:08d}.safetensors")


def _write_ref(refs: str, step: int, state: dict) -> str:
    """Write the reference atomically; if one exists (a replayed step), it must be identical."""
    path = _ref_path(refs, step)
    if os.path.exists(path):
        old = load_file(path)
        bad = [k for k in state if not torch.equal(old[k], state[k])]
        return f"replayed step {step} differs in {bad[:5]}" if bad else ""
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, tmp)
    os.replace(tmp, path)
    return ""


def crash_job(
    rank: int, world: int, root: str, refs: str, checks: str, it: int, mode: str | None, fault: dict | None,
    incremental: bool = False,
) -> dict:
    marker = os.path.join(checks, f"fired_{it:04d}.json")
    hook = Fault(fault, rank, marker)
    storage = FaultStorage(root, hook)
    model, opt = build("fsdp2", CFG, seed=0)
    if incremental:  # a frozen part that incremental saves reference instead of writing
        for name, p in model.named_parameters():
            if name.startswith(("tok.", "pos.")):
                p.requires_grad_(False)
    state = {"model": model, "optimizer": opt}
    mgr = CheckpointManager(
        storage, interval=INTERVAL, keep_last=KEEP_LAST, mode=mode, timeout=60, on_hang="log",
        fault_hook=hook, write_hint=True, incremental=incremental,
    )
    newest = mgr.steps()[-1] if mgr.steps() else None  # listed before the restore (rank-local)
    step = mgr.restore(state)
    check = {"it": it, "rank": rank, "newest": newest, "restored": step, "diff": [], "replay": []}
    if step is not None:
        got = full_state(model, opt)  # collective
        if rank == 0:
            ref = load_file(_ref_path(refs, step))
            check["diff"] = sorted(set(ref) ^ set(got)) + [k for k in ref if k in got and not torch.equal(ref[k], got[k])]
    if rank == 0:
        with open(os.path.join(checks, f"check_{it:04d}.json"), "w") as f:
            json.dump(check, f)
    if hook.active() and hook.spec["phase"] == "anytime":
        hook.fire(float(hook.spec.get("delay", 0.5)))
    start = step or 0
    for s in range(start + 1, start + STEPS_PER_LAUNCH + 1):
        train_step(model, opt, s, CFG)
        if s % INTERVAL == 0:
            ref = full_state(model, opt)  # collective; rank 0 keeps the reference before the save starts
            if rank == 0:
                msg = _write_ref(refs, s, ref)
                if msg:
                    check["replay"].append(msg)
        mgr.maybe_save(s, state)
    mgr.close()
    if rank == 0 and check["replay"]:
        with open(os.path.join(checks, f"check_{it:04d}.json"), "w") as f:
            json.dump(check, f)
    return check


# ------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, args: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)  # a stuck survivor never blocks the driver
    t0 = time.monotonic()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t1 = time.monotonic()
    crash_job(rank, world, **args)
    t2 = time.monotonic()
    dist.destroy_process_group()
    if os.environ.get("CRASH_DEBUG"):
        print(f"rank {rank}: init {t1 - t0:.2f}s job {t2 - t1:.2f}s destroy {time.monotonic() - t2:.2f}s", file=sys.stderr)


def drive(plan_path: str) -> None:
    """Run every launch of a plan, one after another, forking the ranks from this process.

    This process imports torch once and never runs a torch op, so forking is
    safe and each launch costs no interpreter start. Writes
    ``launch_NNNN.json`` (how the launch ended) next to the check files.
    """
    import torch.multiprocessing as mp

    # Import once here what every rank would import on its own (FSDP2 pulls in dynamo).
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    with open(plan_path) as f:
        plan = json.load(f)
    for args in plan["launches"]:
        t0 = time.monotonic()
        try:
            mp.start_processes(_entry, args=(2, _free_port(), args), nprocs=2, start_method="fork", join=True)
            status, detail = "ok", ""
        except Exception as e:  # noqa: BLE001 - a killed rank ends its launch; the checks decide
            status, detail = type(e).__name__, "".join(traceback.format_exception(e))[-4000:]
        with open(os.path.join(args["checks"], f"launch_{args['it']:04d}.json"), "w") as f:
            json.dump({"status": status, "detail": detail, "seconds": time.monotonic() - t0}, f)


if __name__ == "__main__":
    drive(sys.argv[1])
