"""Local backend writes: sequential vs positional buffered writes vs O_DIRECT, raw and through ``sp.save``.

One process saves one training state (a TinyGPT and its AdamW after one
step, so the optimizer state exists; about 460 MB by default) to a folder on
the local filesystem, again and again, in these ways:

- raw files (the state's tensors written back to back into one file, 64-byte
  aligned as shardpoint lays them out, then fsync of the file and folder):
  - ``os.write`` sequential, buffered (for comparison);
  - ``LocalStorage`` writer, positional ``os.pwrite``, buffered;
  - ``LocalStorage(direct=True)`` writer, O_DIRECT with 1 staging buffer
    (written in the caller's thread) and with 2 (a writing thread);
- ``sp.save`` of the state with ``LocalStorage`` buffered, O_DIRECT with 1
  and with 2 buffers;
- ``sp.load`` right after each ``sp.save`` (O_DIRECT leaves nothing in the
  page cache, buffered writes leave the whole file there) and, with
  ``--drop-caches`` (root), cold loads too.

Each repetition runs every case once, on fresh files, in orders balanced
for the case that ran before (a Williams design, ``report.carryover_order``).
Every load is checked bit-exact. Prints MB/s as median [min, max], the CPU
seconds of this process per operation, and ratios to the buffered baseline.

Usage (with no other benchmark running on the machine)::

    .venv/bin/python bench/bench_local_io.py --reps 7 --drop-caches   # root: cold page cache per case
    .venv/bin/python bench/bench_local_io.py --reps 5 --dir /dev/shm  # tmpfs
    .venv/bin/python bench/bench_local_io.py --quick

CPU seconds are this process's (user + system, all threads); the kernel's
writeback threads that flush buffered writes are not counted.
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
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import report as R  # noqa: E402
from shardpoint.storage.local import fsync_path  # noqa: E402
import shardpoint as sp  # noqa: E402
from shardpoint.format.datafile import padding  # noqa: E402
from shardpoint.storage import LocalStorage  # noqa: E402
from shardpoint.testing import GPTConfig, TinyGPT, train_step  # noqa: E402

DEFAULT_CFG = dict(vocab=2048, dim=768, heads=12, layers=5, seq=16)
QUICK_CFG = dict(vocab=1024, dim=384, heads=6, layers=4, seq=16)


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (Linux /proc/self/mounts; '?' elsewhere)."""
    best, kind = "", "?"
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def build_state(cfg: dict) -> dict:
    torch.manual_seed(0)
    c = GPTConfig(**cfg)
    model = TinyGPT(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, 0, c)
    return {"model": model, "optimizer": opt}


def tensors_of(state: dict) -> list[torch.Tensor]:
    sd = state["model"].state_dict()
    out = [t.detach().contiguous() for t in sd.values()]
    for s in state["optimizer"].state.values():
        out += [t.detach().contiguous() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


def blobs_of(tensors: list[torch.Tensor]) -> list[memoryview]:
    """The byte views written by the raw cases, with the 64-byte padding shardpoint uses."""
    out, pos = [], 0
    for t in tensors:
        gap = padding(pos)
        if gap:
            out.append(memoryview(bytes(gap)))
            pos += gap
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        out.append(mv)
        pos += len(mv)
    return out


def raw_sequential(folder: str, blobs: list[memoryview]) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "data.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for mv in blobs:
            while len(mv):
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(folder)


def raw_storage(folder: str, blobs: list[memoryview], **opts) -> None:
    with LocalStorage(folder, **opts).open_writer("data.bin") as w:
        for mv in blobs:
            w.write(mv)


def same_state(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    if any(not torch.equal(sa[k], sb[k]) for k in sa):
        return False
    oa, ob = a["optimizer"].state_dict()["state"], b["optimizer"].state_dict()["state"]
    return all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])


def fresh_like(cfg: dict) -> dict:
    torch.manual_seed(1)
    c = GPTConfig(**cfg)
    model = TinyGPT(c)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def summary(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small state, 3 repetitions")
    ap.add_argument("--dir", default=None, help="folder on the filesystem to test (default: the temp folder)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before every case (root)")
    ap.add_argument("--buffer-mib", type=int, default=8, help="O_DIRECT staging buffer size")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()
    cfg = QUICK_CFG if args.quick else DEFAULT_CFG
    reps = 3 if args.quick else args.reps
    if args.drop_caches:
        if not C.drop_caches():
            raise SystemExit("--drop-caches needs root")

    torch.set_num_threads(1)
    state = build_state(cfg)
    tensors = tensors_of(state)
    blobs = blobs_of(tensors)
    raw_bytes = sum(len(b) for b in blobs)
    target = fresh_like(cfg)
    root = tempfile.mkdtemp(prefix="bench_local_io_", dir=args.dir)
    buf = args.buffer_mib << 20
    direct1 = dict(direct=True, direct_buffers=1, direct_buffer_size=buf)
    direct2 = dict(direct=True, direct_buffers=2, direct_buffer_size=buf)

    saves: dict[str, Callable[[str], None]] = {
        "raw os.write, buffered": lambda p: raw_sequential(p, blobs),
        "raw pwrite, buffered": lambda p: raw_storage(p, blobs),
        "raw O_DIRECT, 1 buffer": lambda p: raw_storage(p, blobs, **direct1),
        "raw O_DIRECT, 2 buffers": lambda p: raw_storage(p, blobs, **direct2),
        "sp.save buffered (pwrite)": lambda p: sp.save(LocalStorage(p), state),
        "sp.save O_DIRECT, 1 buffer": lambda p: sp.save(LocalStorage(p, **direct1), state),
        "sp.save O_DIRECT, 2 buffers": lambda p: sp.save(LocalStorage(p, **direct2), state),
    }
    names = list(saves)
    res: dict[str, dict[str, list[float]]] = {n: {"save": [], "save_cpu": [], "load_after": [], "load_cold": []} for n in names}
    save_bytes = 0
    try:
        # One unmeasured round: page faults of fresh buffers, imports, the first file system metadata.
        for n in names:
            p = os.path.join(root, "warmup")
            saves[n](p)
            shutil.rmtree(p)
        for rep in range(reps):
            order = [names[j] for j in R.carryover_order(len(names), rep)]
            for n in order:
                p = os.path.join(root, f"r{rep}")
                if args.drop_caches:
                    C.drop_caches()
                c0, t0 = time.process_time(), time.perf_counter()
                saves[n](p)
                t1, c1 = time.perf_counter(), time.process_time()
                nbytes = raw_bytes
                if n.startswith("sp.save"):
                    nbytes = sum(os.path.getsize(os.path.join(p, "data", f)) for f in os.listdir(os.path.join(p, "data")))
                    save_bytes = nbytes
                    # Right after the save: buffered writes left the file in the page cache, O_DIRECT did not.
                    for kind in ("load_after", "load_cold") if args.drop_caches else ("load_after",):
                        if kind == "load_cold":
                            C.drop_caches()
                        for t in target["model"].state_dict().values():
                            t.zero_()
                        target["optimizer"] = torch.optim.AdamW(target["model"].parameters(), lr=1e-3)
                        l0 = time.perf_counter()
                        sp.load(p, target)
                        dt = time.perf_counter() - l0
                        if not same_state(state, target):
                            raise SystemExit(f"{n}: the load is not bit-exact")
                        res[n][kind].append(nbytes / dt / 1e6)
                res[n]["save"].append(nbytes / (t1 - t0) / 1e6)
                res[n]["save_cpu"].append(c1 - c0)
                shutil.rmtree(p)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"state: {sum(t.numel() * t.element_size() for t in tensors) / 1e6:.0f} MB in {len(tensors)} tensors; "
          f"raw file {raw_bytes / 1e6:.0f} MB, sp.save data {save_bytes / 1e6:.0f} MB; {reps} reps; "
          f"filesystem {fs_type(root)}; O_DIRECT buffers {args.buffer_mib} MiB; "
          f"page cache dropped before each case: {'yes' if args.drop_caches else 'no'}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    out: dict[str, dict] = {}
    for n in names:
        out[n] = {k: summary(v) for k, v in res[n].items() if v}
        s, c = out[n]["save"], out[n]["save_cpu"]
        line = f"{n:30s} save {s['median']:6.0f} MB/s [{s['min']:5.0f}, {s['max']:5.0f}]  cpu {c['median']:.2f} s"
        for kind, label in (("load_after", "load after save"), ("load_cold", "cold load")):
            if kind in out[n]:
                x = out[n][kind]
                line += f"   {label} {x['median']:6.0f} MB/s [{x['min']:5.0f}, {x['max']:5.0f}]"
        print(line)
    print()
    for base, group in (("raw os.write, buffered", [n for n in names if n.startswith("raw")]),
                        ("sp.save buffered (pwrite)", [n for n in names if n.startswith("sp.save")])):
        b = out[base]
        for n in group:
            if n == base:
                continue
            line = f"{n:30s} / {base:26s} save {out[n]['save']['median'] / b['save']['median']:5.2f}x"
            line += f"  cpu {out[n]['save_cpu']['median'] / b['save_cpu']['median']:5.2f}x"
            for kind in ("load_after", "load_cold"):
                if kind in out[n]:
                    line += f"  {kind} {out[n][kind]['median'] / b[kind]['median']:5.2f}x"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cfg": cfg, "reps": reps, "raw_bytes": raw_bytes, "save_bytes": save_bytes,
                       "drop_caches": args.drop_caches, "fs": fs_type(args.dir or tempfile.gettempdir()),
                       "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
