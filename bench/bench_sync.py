"""Synchronous save and load: shardpoint against torch.distributed.checkpoint (DCP).

Both systems checkpoint the SAME 4-rank FSDP2 state (a TinyGPT and its AdamW
after one step, so the optimizer state exists) in the same run:

- save (4 ranks): ``sp.save`` vs ``get_state_dict`` + ``dcp.save``;
- same-layout load (4 ranks, FSDP2) into a freshly built model and optimizer:
  ``sp.load`` vs ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``;
- resharding load: the 4-rank checkpoints into FSDP2 on 2 ranks (a second launch).

Loads run cold (page cache dropped first, when allowed) and then warm (the
same files again, now cached). Every load is checked bit-exactly against the
reference state captured before the saves, so a broken load fails the run
instead of producing a fast number. Each measurement is repeated, the two
systems alternating which goes first, and reported as median [min, max].
Times are the slowest rank's, measured from a barrier.

    .venv/bin/python bench/bench_sync.py            # default (~460 MB of state)
    .venv/bin/python bench/bench_sync.py --quick    # small state, 2 repeats
    .venv/bin/python bench/bench_sync.py --json out.json --repeats 5
    .venv/bin/python bench/bench_sync.py --size 1.5gb --layout ddp   # suite sizes and layouts

``--layout`` picks the 4-rank layout that saves and loads (``fsdp2``, the
default; ``ddp``; ``2d``: FSDP2 x TP on a 2 x 2 mesh); ``--reshard-layout``
the layout of the resharding load (FSDP2 on ``--reshard-world`` ranks by
default). ``--size`` picks one of the suite's state sizes (``100mb``, ``1.5gb``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("shardpoint", "dcp")
LABEL = {"shardpoint": "shardpoint", "dcp": "DCP"}

DEFAULT_CFG = dict(vocab=2048, dim=768, heads=12, layers=5, seq=16)
QUICK_CFG = dict(vocab=1024, dim=384, heads=6, layers=4, seq=16)


# ====================================================================== helpers (ranks and parent)
def proc_io() -> dict[str, int]:
    """/proc/self/io: rchar/wchar count every byte through read/write calls (page-cache hits
    included); read_bytes/write_bytes count bytes fetched from / sent to the block device."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def cpu_stat() -> tuple[float, float]:
    """Machine-wide (busy, total) CPU seconds from /proc/stat; iowait counts as idle."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (total - v[3] - v[4]) / hz, total / hz


def own_cpu() -> float:
    """CPU seconds this process has used, all threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of the machine's CPU that was busy over the next ``seconds``."""
    b0, t0 = cpu_stat()
    time.sleep(seconds)
    b1, t1 = cpu_stat()
    return (b1 - b0) / max(t1 - t0, 1e-9)


def wait_quiet(max_busy: float, max_wait: float) -> dict:
    """Wait until other work leaves the machine mostly idle (while our ranks sit at a barrier)."""
    t0 = time.monotonic()
    busy = busy_fraction()
    while max_busy > 0 and busy > max_busy and time.monotonic() - t0 < max_wait:
        print(f"# machine busy ({busy:.0%} of {os.cpu_count()} CPUs used by other work); waiting", flush=True)
        time.sleep(3)
        busy = busy_fraction()
    return {"busy_before": round(busy, 3), "waited_s": round(time.monotonic() - t0, 1), "quiet": busy <= max_busy or max_busy <= 0}


def dir_usage(path: str) -> dict[str, int]:
    """Files, apparent bytes (st_size) and allocated bytes (st_blocks) under ``path``."""
    n = size = alloc = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            n += 1
            size += st.st_size
            alloc += st.st_blocks * 512
    return {"files": n, "bytes": size, "allocated": alloc}


def progress(root: str, msg: str) -> None:
    """A line for the parent to show while the ranks run (launch() captures their output)."""
    with open(os.path.join(root, "progress.log"), "a") as f:
        f.write(msg + "\n")


def summary(values) -> dict[str, Any]:
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


# ====================================================================== rank side
def _local(t):
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _named_local(model, opt) -> dict[str, tuple[Any, Any]]:
    """Every model and optimizer tensor of this rank: name -> (live tensor, local tensor).

    Names match :func:`shardpoint.testing.full_state` (``model.<param>``, ``opt.<param>.<state>``).
    """
    from torch import nn

    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    out = {f"model.{k}": (v, _local(v)) for k, v in model.state_dict().items() if hasattr(v, "detach")}
    names = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                if hasattr(v, "detach"):
                    out[f"opt.{names[id(p)]}.{k}"] = (v, _local(v))
    return out


def fingerprint(t) -> tuple[str, tuple, str]:
    """dtype, shape and xxh3 of the raw bytes: a bit-exact identity without keeping a copy."""
    import torch
    import xxhash

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return (str(t.dtype), tuple(t.shape), xxhash.xxh3_128_hexdigest(raw))


def live_expected(model, opt) -> dict:
    """Fingerprints of this rank's own local tensors: what a same-layout load must restore."""
    return {name: fingerprint(loc) for name, (_live, loc) in _named_local(model, opt).items()}


def expected_local(model, opt, ref_full: dict) -> dict:
    """Fingerprints of the slices of the full reference that this rank's shards must hold after a load.

    ``model``/``opt`` only give the geometry (a freshly built, stepped pair). The geometry
    must be contiguous boxes (Shard/Replicate placements; not 2-D's strided shards).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, (live, _loc) in _named_local(model, opt).items():
        full = ref_full[name]
        if hasattr(live, "device_mesh"):
            shape, off = compute_local_shape_and_global_offset(live.shape, live.device_mesh, live.placements)
            full = full[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        out[name] = fingerprint(full)
    return out


def check_exact(model, opt, expected: dict, what: str) -> None:
    """Raise unless every local tensor equals the expected one bit for bit (dtype included).

    ``expected`` holds :func:`fingerprint` s (dtype, shape, xxh3-128 of the raw bytes), so no
    copy of the state is kept: a 1.5 GB DDP state would need 4 more copies on the machine.
    """
    got = _named_local(model, opt)
    if sorted(got) != sorted(expected):
        diff = sorted(set(got) ^ set(expected))
        raise AssertionError(f"{what}: tensor names differ from the reference: {diff[:10]}")
    bad = []
    for k, want in expected.items():
        if fingerprint(got[k][1]) != tuple(want):
            bad.append(k)
    if bad:
        raise AssertionError(f"{what}: NOT bit-exact in {len(bad)} of {len(expected)} tensors, e.g. {bad[:5]}")


class Timer:
    """Run ``fn`` on every rank between barriers; gather each rank's seconds and I/O counters."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist

    def __call__(self, fn: Callable[[], dict | None]) -> dict:
        dist = self.dist
        dist.barrier()
        io0 = proc_io()
        c0 = own_cpu()
        m0 = cpu_stat()
        t0 = time.perf_counter()
        extra = fn() or {}
        el = time.perf_counter() - t0
        m1 = cpu_stat()
        c1 = own_cpu()
        io1 = proc_io()
        mine = {"seconds": el, "cpu": c1 - c0, "machine_busy": m1[0] - m0[0],
                "io": {k: io1.get(k, 0) - io0.get(k, 0) for k in io1}, **extra}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        dist.barrier()
        phases: dict[str, float] = {}
        reported: dict[str, float] = {}
        for r in every:
            for k, v in r.get("phases", {}).items():
                phases[k] = max(phases.get(k, 0.0), v)
            for k, v in r.get("phases_reported", {}).items():
                reported[k] = max(reported.get(k, 0.0), v)
        io = {k: sum(r["io"].get(k, 0) for r in every) for k in ("rchar", "wchar", "read_bytes", "write_bytes")}
        slowest = max(r["seconds"] for r in every)
        own = sum(r["cpu"] for r in every)
        out = {
            "seconds": slowest,
            # CPU seconds the ranks used (all threads), and the average number of CPUs that
            # other processes kept busy meanwhile (rank 0's view of the whole machine).
            "cpu_seconds_sum": own,
            "other_cpus": max(0.0, every[0]["machine_busy"] - own) / max(slowest, 1e-9),
            "per_rank_seconds": [r["seconds"] for r in every],
            "phases_max": phases,
            "phases_reported_max": reported,
            "io_sum": io,
        }
        for key in ("bytes_written", "bytes_read", "bytes_received"):
            if any(key in r for r in every):
                out[key + "_sum"] = sum(r.get(key, 0) for r in every)
        return out


def phase_walls(recorder) -> dict[str, float]:
    """Seconds during which each phase was running: the union of its spans.

    shardpoint's own ``timings`` add spans up, so phases whose spans nest (an outer
    ``write`` around per-tensor ``write`` spans) or overlap (reads on prefetch threads)
    can add up to more than the wall time; the union cannot.
    """
    by: dict[str, list[tuple[float, float]]] = {}
    for sp_ in recorder.spans:
        by.setdefault(sp_.phase, []).append((sp_.start, sp_.end))
    out = {}
    for ph, iv in by.items():
        iv.sort()
        total, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
        for a, b in iv[1:]:
            if a > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        out[ph] = total + (cur_e - cur_s)
    return out


def _dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_with(system: str, model, opt, path: str) -> dict:
    if system == "shardpoint":
        import shardpoint as sp

        res = sp.save(path, {"model": model, "optimizer": opt})
        return {"phases": phase_walls(res.recorder), "phases_reported": dict(res.timings), "bytes_written": res.bytes_written}
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    sd = _dcp_state(model, opt)
    t1 = time.perf_counter()
    dcp.save(sd, checkpoint_id=path)
    t2 = time.perf_counter()
    return {"phases": {"get_state_dict": t1 - t0, "dcp.save": t2 - t1}}


def load_with(system: str, model, opt, path: str) -> dict:
    if system == "shardpoint":
        import shardpoint as sp

        rep = sp.LoadResult()
        sp.load(path, {"model": model, "optimizer": opt}, report=rep)
        return {"phases": phase_walls(rep.recorder), "phases_reported": dict(rep.timings),
                "bytes_read": rep.bytes_read, "bytes_received": rep.bytes_received}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    t0 = time.perf_counter()
    # A fresh optimizer has no state: get_state_dict initialises it with a zero-gradient
    # step, and dcp.load then overwrites every entry (step included) in place.
    sd = _dcp_state(model, opt)
    t1 = time.perf_counter()
    dcp.load(sd, checkpoint_id=path)
    t2 = time.perf_counter()
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    t3 = time.perf_counter()
    return {"phases": {"get_state_dict": t1 - t0, "dcp.load": t2 - t1, "set_state_dict": t3 - t2}}


def _order(i: int) -> tuple[str, ...]:
    return SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]


def _fresh(layout: str, cfg):
    from shardpoint.testing import build

    gc.collect()
    return build(layout, cfg, seed=1234)  # a different init: the load must overwrite everything


def _cold_and_warm_loads(system, path, rank, layout, cfg, expected, drop, timer, what) -> dict:
    """Load ``path`` twice into fresh targets: first after dropping the page cache, then warm."""
    import torch.distributed as dist

    out = {}
    for kind in ("cold", "warm"):
        model, opt = _fresh(layout, cfg)
        dist.barrier()
        if kind == "cold" and drop and rank == 0:
            C.drop_caches()
        r = timer(lambda m=model, o=opt: load_with(system, m, o, path))
        check_exact(model, opt, expected, f"{what} {kind} load with {system}")
        r["cache"] = "dropped" if (kind == "cold" and drop) else "warm"
        out[kind] = r
        del model, opt
    return out


def same_layout_job(rank: int, world: int, root: str, cfg: dict, repeats: int, warmup: int, drop: bool, max_busy: float = 0.0, max_wait: float = 0.0, wait_budget: float = 0.0, layout: str = "fsdp2") -> dict | None:
    """4 ranks: train one step, save with both systems, load back into fresh targets of the same layout."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from shardpoint.testing import GPTConfig, build, full_state, train_step

    c = GPTConfig(**cfg)
    timer = Timer()
    model, opt = build(layout, c, seed=0)
    train_step(model, opt, 0, c)  # AdamW now has exp_avg, exp_avg_sq and step for every parameter
    ref_full = full_state(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in ref_full.values())
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref_full.items()}, os.path.join(root, "ref.safetensors"))
    # 2-D shards are strided (not boxes of the full tensor): there the reference is the live shards.
    expected = live_expected(model, opt) if layout == "2d" else expected_local(model, opt, ref_full)
    del ref_full
    gc.collect()
    check_exact(model, opt, expected, "reference geometry")

    rounds = []
    waited = 0.0
    for i in range(warmup + repeats):
        rnd: dict[str, Any] = {"warmup": i < warmup, "order": list(_order(i))}
        dist.barrier()
        if rank == 0:
            rnd["quiet"] = wait_quiet(max_busy, min(max_wait, max(0.0, wait_budget - waited)))
            waited += rnd["quiet"]["waited_s"]
        dist.barrier()
        for system in _order(i):
            path = os.path.join(root, f"{system}-{i}")
            res: dict[str, Any] = {"save": timer(lambda: save_with(system, model, opt, path))}
            if rank == 0:
                res["disk"] = dir_usage(path)
            res.update({f"load_{k}": v for k, v in _cold_and_warm_loads(system, path, rank, layout, c, expected, drop, timer, "same-layout").items()})
            rnd[system] = res
            dist.barrier()
            if rank == 0 and i < warmup + repeats - 1:
                shutil.rmtree(path)  # the last round's checkpoints stay for the resharding launch
        rounds.append(rnd)
        if rank == 0:
            progress(root, f"# 4-rank round {i + 1}/{warmup + repeats}{' (warm-up)' if i < warmup else ''}: "
                  + ", ".join(f"{s} save {rnd[s]['save']['seconds']:.2f}s load cold {rnd[s]['load_cold']['seconds']:.2f}s "
                              f"warm {rnd[s]['load_warm']['seconds']:.2f}s" for s in SYSTEMS))
    # The saves must not have changed the live (source) state.
    check_exact(model, opt, expected, "source state after all saves")
    if rank != 0:
        return None
    last = warmup + repeats - 1
    return {
        "state_bytes": state_bytes,
        "tensors": len(expected),
        "rounds": rounds,
        "paths": {s: f"{s}-{last}" for s in SYSTEMS},
        "torch_threads": torch.get_num_threads(),
    }


def reshard_job(rank: int, world: int, root: str, cfg: dict, paths: dict, repeats: int, warmup: int, drop: bool, max_busy: float = 0.0, max_wait: float = 0.0, wait_budget: float = 0.0, layout: str = "fsdp2") -> dict | None:
    """2 ranks: load the 4-rank checkpoints of both systems into ``layout`` (FSDP2) on 2 ranks."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardpoint.testing import GPTConfig

    c = GPTConfig(**cfg)
    timer = Timer()
    if layout == "2d":
        raise ValueError("the resharding target must have box-shaped shards (fsdp2, tp, ddp, single), not 2d")
    model, opt = _fresh(layout, c)
    from shardpoint.testing import train_step

    train_step(model, opt, 0, c)  # only to give the optimizer state its geometry
    ref_full = load_file(os.path.join(root, "ref.safetensors"))
    expected = expected_local(model, opt, ref_full)
    del ref_full, model, opt
    gc.collect()
    rounds = []
    waited = 0.0
    for i in range(warmup + repeats):
        rnd: dict[str, Any] = {"warmup": i < warmup, "order": list(_order(i))}
        dist.barrier()
        if rank == 0:
            rnd["quiet"] = wait_quiet(max_busy, min(max_wait, max(0.0, wait_budget - waited)))
            waited += rnd["quiet"]["waited_s"]
        dist.barrier()
        for system in _order(i):
            path = os.path.join(root, paths[system])
            rnd[system] = {f"load_{k}": v for k, v in _cold_and_warm_loads(system, path, rank, layout, c, expected, drop, timer, f"4->{world} reshard").items()}
        rounds.append(rnd)
        if rank == 0:
            progress(root, f"# {world}-rank round {i + 1}/{warmup + repeats}{' (warm-up)' if i < warmup else ''}: "
                  + ", ".join(f"{s} load cold {rnd[s]['load_cold']['seconds']:.2f}s warm {rnd[s]['load_warm']['seconds']:.2f}s"
                              for s in SYSTEMS))
    return {"rounds": rounds} if rank == 0 else None


# ====================================================================== parent side
def _launch_showing_progress(root: str, world: int, target: str, args: dict) -> Any:
    """launch() on ``world`` ranks, printing the progress lines rank 0 writes meanwhile."""
    import threading

    from shardpoint.testing import launch

    box: dict[str, Any] = {}
    log, seen = os.path.join(root, "progress.log"), 0
    if os.path.exists(log):
        os.unlink(log)

    def run():
        try:
            box["value"] = launch(world, target, args, timeout=3000)[0]
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while True:
        t.join(1.0)
        try:
            with open(log) as f:
                f.seek(seen)
                new = f.read()
                seen += len(new)
            if new:
                print(new, end="", flush=True)
        except OSError:
            pass
        if not t.is_alive():
            break
    if "error" in box:
        raise box["error"]
    return box["value"]


def _fs_of(path: str) -> dict:
    """Filesystem type and device holding ``path`` (from /proc/mounts; no path is recorded)."""
    best = ("", "", "")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, typ)
    except OSError:
        pass
    return {"device": os.path.basename(best[0]), "fstype": best[2]}


def _pick_root(base: str | None) -> str:
    if base is None:
        base = tempfile.gettempdir()
        if _fs_of(base)["fstype"] in ("tmpfs", "ramfs"):
            base = "/var/tmp"
    if _fs_of(base)["fstype"] in ("tmpfs", "ramfs"):
        print(f"# warning: {base} is a memory filesystem; timings will not include the disk", flush=True)
    return tempfile.mkdtemp(prefix="sp-bench-sync-", dir=base)


def disk_probe(root: str, nbytes: int, drop: bool, repeats: int = 3) -> dict:
    """The disk alone, ``repeats`` times: median [min, max] GB/s of :func:`_probe_once`."""
    runs = [_probe_once(root, nbytes, drop) for _ in range(repeats)]
    out: dict[str, Any] = {"bytes": runs[0]["bytes"], "read_cold": runs[0]["read_cold"], "runs": runs}
    for k in ("write_fsync_gbps", "read_gbps", "read_cached_gbps"):
        out[k] = summary(r[k] for r in runs)
    return out


def _probe_once(root: str, nbytes: int, drop: bool) -> dict:
    """One process: write ``nbytes`` in 8 MiB writes + fsync, then read them back (cold if allowed)."""
    path = os.path.join(root, "probe.bin")
    block = bytes(os.urandom(1 << 20)) * 8
    n = max(1, nbytes // len(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(n):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    tw = time.perf_counter() - t0
    cold = drop and C.drop_caches()
    buf = bytearray(len(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.readv(fd, [buf]) > 0:
        pass
    os.close(fd)
    tr = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.readv(fd, [buf]) > 0:
        pass
    os.close(fd)
    tw_read = time.perf_counter() - t0
    os.unlink(path)
    total = n * len(block)
    return {
        "bytes": total,
        "write_fsync_gbps": total / tw / 1e9,
        "read_gbps": total / tr / 1e9,
        "read_cold": bool(cold),
        "read_cached_gbps": total / tw_read / 1e9,
    }


def machine_info() -> dict:
    import psutil
    import torch

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "shardpoint_tree_dirty": bool(git("status", "--porcelain", "--", "shardpoint")),
    }


METRICS = [
    # (key, label, where)
    ("save", "save, 4 ranks", "same"),
    ("load_cold", "load 4->4, cold", "same"),
    ("load_warm", "load 4->4, warm", "same"),
    ("load_cold", "load 4->2 (reshard), cold", "reshard"),
    ("load_warm", "load 4->2 (reshard), warm", "reshard"),
]


def aggregate(same: dict, reshard: dict | None) -> dict:
    out: dict[str, Any] = {}
    for key, label, where in METRICS:
        src = same if where == "same" else reshard
        if not src:
            continue
        rounds = [r for r in src["rounds"] if not r["warmup"]]
        row: dict[str, Any] = {"label": label}
        for s in SYSTEMS:
            vals = [r[s][key]["seconds"] for r in rounds]
            row[s] = summary(vals)
            row[s]["values"] = vals
            phases: dict[str, list[float]] = {}
            for r in rounds:
                for ph, v in r[s][key]["phases_max"].items():
                    phases.setdefault(ph, []).append(v)
            row[s]["phases_median_of_max"] = {ph: statistics.median(v) for ph, v in phases.items()}
            row[s]["cpu_seconds_median"] = statistics.median(r[s][key]["cpu_seconds_sum"] for r in rounds)
            row[s]["other_cpus_median"] = statistics.median(r[s][key]["other_cpus"] for r in rounds)
            row[s]["other_cpus_max"] = max(r[s][key]["other_cpus"] for r in rounds)
            row[s]["io_sum_median"] = {k: statistics.median(r[s][key]["io_sum"][k] for r in rounds) for k in rounds[0][s][key]["io_sum"]}
            for extra in ("bytes_written_sum", "bytes_read_sum", "bytes_received_sum"):
                if extra in rounds[0][s][key]:
                    row[s][extra] = rounds[0][s][key][extra]
            warm = [r[s][key]["seconds"] for r in src["rounds"] if r["warmup"]]
            if warm:
                row[s]["warmup_values"] = warm
        a, b = row["shardpoint"]["median"], row["dcp"]["median"]
        row["ratio_sp_over_dcp"] = a / b if a and b else None
        out[f"{where}.{key}"] = row
    disk = {}
    for s in SYSTEMS:
        d = [r[s]["disk"] for r in same["rounds"] if "disk" in r[s]]
        disk[s] = d[-1] if d else {}
    out["disk"] = disk
    q = [r.get("quiet", {}) for src in (same, reshard) if src for r in src["rounds"]]
    out["rounds_started_busy"] = sum(1 for x in q if x and not x.get("quiet", True))
    out["rounds"] = len(q)
    return out


def print_report(res: dict) -> None:
    agg = res["summary"]
    cfg = res["config"]
    mb = res["state_bytes"] / 1e6
    print()
    print(f"State: TinyGPT {cfg['model']} + AdamW after 1 step = {res['tensors']} tensors, {mb:.1f} MB "
          f"(saved on {cfg['world']} ranks, {cfg.get('layout', 'fsdp2')}; resharding load into {cfg.get('reshard_layout', 'fsdp2')} "
          f"on {cfg['reshard_world']}); {cfg['repeats']} measured repeats, {cfg['warmup']} warm-up")
    print(f"Cold loads: page cache {'dropped before each cold load' if res['drop_caches'] else 'NOT dropped (no permission): all loads are warm'}")
    print()
    hdr = f"{'seconds: median [min, max]':<28} {'shardpoint':>24} {'DCP':>24} {'sp/DCP':>7}"
    print(hdr)
    print("-" * len(hdr))
    for key, label, where in METRICS:
        row = agg.get(f"{where}.{key}")
        if not row:
            continue
        cells = []
        for s in SYSTEMS:
            x = row[s]
            cells.append(f"{x['median']:.3f} [{x['min']:.3f}, {x['max']:.3f}]")
        ratio = row["ratio_sp_over_dcp"]
        print(f"{label:<28} {cells[0]:>24} {cells[1]:>24} {ratio:>6.2f}x")
    print()
    print("CPU seconds used by all ranks (median), and other processes' load meanwhile (median / max CPUs busy):")
    for key, label, where in METRICS:
        row = agg.get(f"{where}.{key}")
        if row:
            print(f"  {label:<28} " + "  ".join(
                f"{LABEL[s]} {row[s]['cpu_seconds_median']:6.2f} cpu-s (others {row[s]['other_cpus_median']:.2f} / {row[s]['other_cpus_max']:.2f})"
                for s in SYSTEMS))
    if agg.get("rounds_started_busy"):
        print(f"  WARNING: {agg['rounds_started_busy']} of {agg['rounds']} rounds started while other work kept the machine busy")
    print()
    print("Throughput (state bytes / median seconds), GB/s:")
    for key, label, where in METRICS:
        row = agg.get(f"{where}.{key}")
        if row:
            print(f"  {label:<28} " + "  ".join(f"{LABEL[s]} {res['state_bytes'] / row[s]['median'] / 1e9:5.2f}" for s in SYSTEMS))
    print()
    print("Bytes (summed over ranks, medians of the measured repeats):")
    save = agg["same.save"]
    for s in SYSTEMS:
        d = agg["disk"][s]
        io = save[s]["io_sum_median"]
        print(f"  {LABEL[s]:<11} checkpoint {d.get('files', 0)} files, {d.get('bytes', 0) / 1e6:.1f} MB "
              f"({d.get('allocated', 0) / 1e6:.1f} MB allocated); save wrote {io['write_bytes'] / 1e6:.1f} MB to the device "
              f"({io['wchar'] / 1e6:.1f} MB through write calls)")
    for key, where, label in (("load_cold", "same", "4->4 cold"), ("load_cold", "reshard", "4->2 cold")):
        row = agg.get(f"{where}.{key}")
        if not row:
            continue
        for s in SYSTEMS:
            io = row[s]["io_sum_median"]
            extra = ""
            if "bytes_read_sum" in row[s]:
                extra = f"; shardpoint's own count: {row[s]['bytes_read_sum'] / 1e6:.1f} MB read from storage"
            print(f"  {label} load, {LABEL[s]:<10}: {io['read_bytes'] / 1e6:.1f} MB read from the device, "
                  f"{io['rchar'] / 1e6:.1f} MB through read calls (sockets included){extra}")
    print()
    print("Phases (median over repeats of the slowest rank's seconds; shardpoint's as wall time covered by each phase):")
    for key, label, where in METRICS:
        row = agg.get(f"{where}.{key}")
        if not row:
            continue
        for s in SYSTEMS:
            ph = row[s]["phases_median_of_max"]
            print(f"  {label:<28} {LABEL[s]:<10} " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    if res.get("disk_probe"):
        p = res["disk_probe"]
        print()
        def g(x):
            return f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"

        print(f"Disk probe (1 process, one {p['bytes'] / 1e6:.0f} MB file in 8 MiB writes, {len(p['runs'])} times), GB/s: "
              f"write+fsync {g(p['write_fsync_gbps'])}, read {'cold' if p['read_cold'] else 'warm'} {g(p['read_gbps'])}, "
              f"read again (cached) {g(p['read_cached_gbps'])}")
    la = res.get("load_average", {})
    print(f"Load average: {la.get('start')} at start, {la.get('end')} at the end (other work on the machine skews timings)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small state (~100 MB), 2 repeats, no warm-up round")
    ap.add_argument("--repeats", type=int, default=None, help="measured repeats per system (default 5; 2 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured warm-up rounds first (default 1; 0 with --quick)")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--world", type=int, default=4, help="ranks that save (FSDP2)")
    ap.add_argument("--size", default=None, help="a suite state size (100mb, 1.5gb): sets vocab, dim, heads, layers "
                    "(--dim/--layers still override)")
    ap.add_argument("--layout", default="fsdp2", choices=("fsdp2", "ddp", "2d", "hsdp", "tp"),
                    help="layout of the ranks that save and load (default fsdp2; 2d = FSDP2 x TP on a 2 x (world/2) mesh)")
    ap.add_argument("--reshard-layout", default="fsdp2", choices=("fsdp2", "ddp", "tp"),
                    help="layout of the resharding load (default fsdp2)")
    ap.add_argument("--reshard-world", type=int, default=2, help="ranks of the resharding load (0 to skip it)")
    ap.add_argument("--dir", default=None, help="parent folder for the checkpoints (default: the temp dir, if on disk)")
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="before each round, wait while other work keeps more than this fraction of the CPUs busy (0: never wait)")
    ap.add_argument("--max-wait", type=float, default=None, help="seconds to wait for a quiet machine per round (default 30; 5 with --quick)")
    ap.add_argument("--wait-budget", type=float, default=None,
                    help="total seconds of such waiting per launch (default 90; 10 with --quick)")
    ap.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache (all loads warm)")
    ap.add_argument("--no-disk-probe", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args(argv)

    cfg = dict(QUICK_CFG if args.quick else DEFAULT_CFG)
    if args.size:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _common import size_cfg

        cfg = size_cfg(args.size)
    if args.dim:
        cfg["dim"] = args.dim
        cfg["heads"] = max(1, args.dim // 64)
    if args.layers:
        cfg["layers"] = args.layers
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    max_wait = args.max_wait if args.max_wait is not None else (5.0 if args.quick else 30.0)
    wait_budget = args.wait_budget if args.wait_budget is not None else (10.0 if args.quick else 90.0)
    if repeats < 1:
        ap.error("--repeats must be at least 1")

    # The ranks import this module as bench.bench_sync: launch() puts the working directory on
    # their PYTHONPATH, so run from the repository root.
    os.chdir(REPO)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the checkpoints

    root = _pick_root(args.dir)
    drop = not args.no_drop_caches and C.drop_caches()
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "bench_sync",
        # Paths are shortened to their last part, so that results can be shared without machine paths.
        "command": " ".join(["bench/bench_sync.py"] + [os.path.basename(a) if os.sep in a else a
                                                        for a in (argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "checkpoint_fs": _fs_of(root),
        "drop_caches": drop,
        "load_average": {"start": [round(x, 2) for x in os.getloadavg()]},
        "config": {"model": cfg, "repeats": repeats, "warmup": warmup, "world": args.world,
                   "reshard_world": args.reshard_world, "layout": args.layout, "reshard_layout": args.reshard_layout,
                   "size": args.size, "optimizer": "AdamW(lr=1e-2)",
                   "torch_threads_per_rank": 1, "max_busy": args.max_busy, "max_wait": max_wait, "wait_budget": wait_budget},
    }
    print(f"# checkpoints under a temp dir on {result['checkpoint_fs']['fstype'] or '?'} "
          f"({result['checkpoint_fs']['device'] or '?'}); page cache drop: {'yes' if drop else 'no'}", flush=True)
    try:
        same = _launch_showing_progress(root, args.world, "bench.bench_sync:same_layout_job",
                                        {"root": root, "cfg": cfg, "repeats": repeats, "warmup": warmup, "drop": drop,
                                         "max_busy": args.max_busy, "max_wait": max_wait, "wait_budget": wait_budget,
                                         "layout": args.layout})
        result["state_bytes"] = same["state_bytes"]
        result["tensors"] = same["tensors"]
        reshard = None
        if args.reshard_world:
            reshard = _launch_showing_progress(root, args.reshard_world, "bench.bench_sync:reshard_job",
                                               {"root": root, "cfg": cfg, "paths": same["paths"], "repeats": repeats,
                                                "warmup": warmup, "drop": drop, "max_busy": args.max_busy, "max_wait": max_wait, "wait_budget": wait_budget,
                                                "layout": args.reshard_layout})
        if not args.no_disk_probe:
            result["disk_probe"] = disk_probe(root, same["state_bytes"], drop)
        result["summary"] = aggregate(same, reshard)
        result["raw"] = {"same_layout": same["rounds"], "reshard": reshard["rounds"] if reshard else None}
    finally:
        if args.keep:
            print(f"# kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["load_average"]["end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_seconds"] = time.perf_counter() - t_start
    print_report(result)
    print(f"\nTotal wall time {result['wall_seconds']:.0f} s")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
