"""The cost of the replica check at save, against the whole save, on the benchmark states.

Each layout's 4-rank TinyGPT state (model and AdamW after one step, at a
suite size) is saved ``--repeats`` times with ``sp.save``; the replica
check's parts are then timed alone on the same prepared tensors, the way
the save runs them:

- ``check_s``: what the check adds to a save without declared groups (the
  default), its parts timed one after the other: the digests and the int64
  table (``at_call_s``: on the training thread in an asynchronous save; a
  blocking save computes them on a thread alongside its write), rank 0's
  comparison of every rank's table at the commit, and the table's extra
  bytes in the commit's first gather (``gather_extra_s``, the gather with
  the table less the gather without it, at least 0);
- ``sync_s``: the check's part of a blocking save's critical path: the time
  its summary waited for the digests (``wait_s``: the part the write did
  not hide), the comparison and the gather's extra bytes;
- ``ab_share``: the whole save with the check against the same save with
  the check left out, ``2 * --repeats`` of each in alternating order: the
  check's cost as a blocking save pays it, contention for the interpreter
  included (the median of the differences of saves run back to back; still
  noisy on a loaded machine);
- ``prewrite_s``: what a save with ``replicated_over`` adds before its
  write: one gather of which pieces each rank holds in which group (its
  digests are compared at the commit, as above);
- ``eager_*`` and ``lazy_*``: an :class:`~shardpoint.AsyncSaver`'s saves
  with the check and without it, alternating: ``*_call_s`` the call (the
  training thread's stall), ``*_save_s`` the whole save until ``wait()``
  returns, and each paired difference as a share of the whole save.

Times are the slowest rank's, from a barrier; the report gives medians and
each one's share of the save, in wall-clock time and (for ``check_s``) in
the CPU time of the checking thread (on a machine with fewer cores than
ranks, wall-clock spans include scheduling waits). DDP is the worst case:
every rank holds, and digests, the whole state.

    .venv/bin/python bench/bench_replicas.py                     # 100mb, ddp fsdp2 hsdp 2d
    .venv/bin/python bench/bench_replicas.py --size 1.5gb --layouts ddp
    .venv/bin/python bench/bench_replicas.py --device cuda       # digests on the GPU (one process)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def _replace_policy():
    """Replaced checkpoints' files are deleted at once: a save every second would fill the disk in the grace period."""
    import shardpoint as sp

    return sp.CommitPolicy(cleanup_grace_s=0)



def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of ``fn`` on the slowest rank, from a barrier; its CPU seconds (this thread) appended to ``cpu``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    c1, t1 = time.thread_time(), time.perf_counter()
    if cpu is not None:
        cpu.append(_slowest(c1 - c0))
    return _slowest(t1 - t0)


def _medians(fn, repeats: int, cpu: list | None = None) -> float:
    """Median wall seconds of ``fn`` (slowest rank) over ``repeats`` runs after one warm-up."""
    return statistics.median([_timed(fn, cpu) for _ in range(repeats + 1)][1:])


def _commit_side(comm, table, repeats: int) -> tuple[float, float]:
    """Rank 0's comparison of every rank's table, and the table's extra cost in a gather to rank 0."""
    from shardpoint.planning.replicas import suspicious

    tables = comm.all_gather(table.encoded)
    compare = _medians(lambda: suspicious(tables) if comm.rank == 0 else None, repeats)
    plain = [_timed(lambda: comm.gather(b"")) for _ in range(2 * repeats + 1)][1:]
    loaded = [_timed(lambda: comm.gather(table.encoded)) for _ in range(2 * repeats + 1)][1:]
    return compare, max(0.0, statistics.median(loaded) - statistics.median(plain))


def _without_check():
    """A stand-in for the check that compares nothing (for the save without it); restores the real one on exit."""
    import contextlib

    from shardpoint.saving import prepare

    @contextlib.contextmanager
    def patched():
        real = prepare.pending_table
        prepare.pending_table = lambda *args, **kwargs: None
        try:
            yield
        finally:
            prepare.pending_table = real

    return patched()


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the differences of saves run back to back: steadier than a difference of medians."""
    return statistics.median(x - y for x, y in zip(a, b))


def _alternating(one, repeats: int) -> None:
    """``one(True)`` (with the check) and ``one(False)``, ``2 * repeats + 1`` times each, the order alternating.

    The first pair is a warm-up, which callers drop.
    """
    for i in range(2 * repeats + 1):
        for check in ((True, False) if i % 2 else (False, True)):
            one(check)


def _ab(save, repeats: int) -> tuple[float, float, float, float]:
    """Median save time with the check and without it, ``2 * repeats`` of each after a warm-up, in alternating order.

    Also the median of the paired differences (:func:`_paired`) and the
    median time a save's summary waited for its digests (the part of the
    digests its write did not hide), slowest rank.
    """
    from shardpoint.saving.replicas import PendingTable

    real, waited = PendingTable.table, []

    def timed_table(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            waited.append(time.perf_counter() - t0)

    times: dict[bool, list[float]] = {True: [], False: []}
    waits: list[float] = []

    def one(check: bool) -> None:
        waited.clear()
        if check:
            times[True].append(_timed(save))
            waits.append(_slowest(sum(waited)))
        else:
            with _without_check():
                times[False].append(_timed(save))

    PendingTable.table = timed_table
    try:
        _alternating(one, repeats)
    finally:
        PendingTable.table = real
    a, b = times[True][1:], times[False][1:]  # after a warm-up pair
    return statistics.median(a), statistics.median(b), _paired(a, b), statistics.median(waits[1:])


def _ab_async(path: str, state: dict, mode: str, repeats: int) -> dict[str, float]:
    """An asynchronous saver's call (the training thread's stall) and whole save, with the check and without it.

    One saver per variant, reused as a training loop does; ``2 * repeats``
    saves of each after a warm-up, alternating. A lazy save is fenced by
    :meth:`wait`, right after its call. Returns the medians of the call
    and the whole save with the check and without it, and the medians of
    their paired differences (slowest rank).
    """
    import contextlib

    import torch.distributed as dist

    import shardpoint as sp

    savers = {True: sp.AsyncSaver(), False: sp.AsyncSaver()}
    calls: dict[bool, list[float]] = {True: [], False: []}
    wholes: dict[bool, list[float]] = {True: [], False: []}

    def one(check: bool) -> None:
        with contextlib.nullcontext() if check else _without_check():
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            h = savers[check].save(path, state, mode=mode, commit=_replace_policy())
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
        calls[check].append(_slowest(t1 - t0))
        wholes[check].append(_slowest(t2 - t0))

    try:
        _alternating(one, repeats)
    finally:
        for saver in savers.values():
            saver.close()
    c, c0, w, w0 = calls[True][1:], calls[False][1:], wholes[True][1:], wholes[False][1:]  # after a warm-up pair
    return {
        "call_s": statistics.median(c), "call_without_s": statistics.median(c0), "call_diff_s": _paired(c, c0),
        "save_s": statistics.median(w), "save_without_s": statistics.median(w0), "save_diff_s": _paired(w, w0),
    }


def job(rank: int, world: int, root: str, cfg: dict, layouts: list[str], repeats: int) -> dict:
    """Per layout: median save time, median check time and the check's share, bytes digested per rank."""
    import shardpoint as sp
    from shardpoint.dist import Comm
    from shardpoint.saving.agree import Gate, Proposal, agree_save
    from shardpoint.saving.options import SaveOptions
    from shardpoint.saving.prepare import prepare_save
    from shardpoint.saving.result import SaveResult
    from shardpoint.saving.replicas import pending_table, rows_of
    from shardpoint.testing import GPTConfig, build, train_step

    c = GPTConfig(**cfg)
    out = {}
    for layout in layouts:
        model, opt = build(layout, c, seed=0)
        train_step(model, opt, 0, c)
        state = {"model": model, "optimizer": opt}
        path = os.path.join(root, layout)
        save, save_off, diff, wait = _ab(lambda: sp.save(path, state, commit=_replace_policy()), repeats)
        comm = Comm.resolve(None)
        prep = prepare_save(state, comm, SaveOptions(), SaveResult(path, "bench"))
        cpu: list[float] = []
        at_call = _medians(lambda: pending_table(prep.tensors, comm).table(), repeats, cpu)
        table = pending_table(prep.tensors, comm).table()
        compare, extra = _commit_side(comm, table, repeats)
        agree = lambda: agree_save(Proposal.of(prep.tensors, frozenset(), (), comm.world), comm, Gate(comm, path))  # noqa: E731
        prewrite = _medians(agree, repeats)  # the agreement of a declared save; digests not included
        check = at_call + compare + extra
        held = [t for t in prep.tensors if t.replica_count > 1 or t.placement == "local"]
        out[layout] = {
            "save_s": save, "check_s": check, "share": check / save,
            "check_cpu_s": statistics.median(cpu[1:]), "cpu_share": statistics.median(cpu[1:]) / save,
            "save_without_s": save_off, "ab_diff_s": diff, "ab_share": diff / save,
            "sync_s": wait + compare + extra, "sync_share": (wait + compare + extra) / save, "wait_s": wait,
            "at_call_s": at_call, "compare_s": compare, "gather_extra_s": extra,
            "digest_s": _medians(lambda: rows_of(prep.tensors), repeats),
            "prewrite_s": prewrite, "prewrite_share": prewrite / save,
            "checked_tensors": len(table.held), "table_bytes": len(table.encoded),
            "checked_bytes": sum(t.nbytes for t in held), "state_bytes": sum(t.nbytes for t in prep.tensors),
        }
        for mode in ("eager", "lazy"):
            r = _ab_async(path, state, mode, repeats)
            out[layout].update({f"{mode}_{k}": v for k, v in r.items()})
            out[layout][f"{mode}_call_share"] = r["call_diff_s"] / r["save_s"]
            out[layout][f"{mode}_save_share"] = r["save_diff_s"] / r["save_s"]
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def gpu_job(cfg: dict, repeats: int) -> dict:
    """One process on CUDA: the digest of every tensor of a model and AdamW state, against a save to /dev/shm."""
    import torch

    import shardpoint as sp
    from shardpoint.saving.digest import digest_all
    from shardpoint.testing import GPTConfig, TinyGPT, batch, loss_of

    c = GPTConfig(**cfg)
    model = TinyGPT(c).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model, *[x.cuda() for x in batch(0, c)]).backward()
    opt.step()
    tensors = [p for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()]
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        saves, digests = [], []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sp.save(os.path.join(root, "ck"), {"model": model, "optimizer": opt})
            saves.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            digest_all(tensors)
            digests.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s, d = statistics.median(saves[1:]), statistics.median(digests[1:])
    return {"cuda": {"save_s": s, "digest_s": d, "share": d / s, "bytes": sum(t.numel() * t.element_size() for t in tensors)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100mb")
    ap.add_argument("--layouts", nargs="+", default=["ddp", "fsdp2", "hsdp", "2d"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    C.setup_env()
    cfg = C.size_cfg(args.size)
    if args.device == "cuda":
        res = gpu_job(cfg, args.repeats)
    else:
        from shardpoint.testing import launch

        root = tempfile.mkdtemp(prefix="sp-bench-replicas-")
        try:
            res = launch(args.world, "bench.bench_replicas:job", {
                "root": root, "cfg": cfg, "layouts": args.layouts, "repeats": args.repeats,
            }, timeout=1800)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for name, r in res.items():
        print(f"{args.size} {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "machine": C.machine_info(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
