"""The machine's own limits, measured by the benchmark suite itself.

Three figures bound what any checkpointing system can do on this machine,
and every result of the suite is also shown as a fraction of one of them:

- **memory copy**: ``dst.copy_(src)`` into a preallocated buffer (torch, 1 and
  2 threads). The anchor for snapshot copies into a staging buffer.
- **sequential write with fsync**: one file per stream, written in 8 MiB
  ``write`` calls, then ``fsync``; 1 and 2 streams (threads, one file each:
  a 4-rank save writes several files at once). The anchor for saves.
- **sequential read**: the same files read back in 8 MiB ``readv`` calls,
  cold (page cache dropped first with ``sync; echo 3 > /proc/sys/vm/drop_caches``
  when running as root, else the file's own pages evicted with
  ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no privilege), and again
  from the page cache. The anchors for cold and warm loads.

Each is repeated; the result is median [min, max] per variant, and the limit
used for fractions is the best variant's median (the most the machine gave).

    .venv/bin/python bench/limits.py                 # 1 GB files, 3 repeats
    .venv/bin/python bench/limits.py --mb 512 --repeats 3 --json limits.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

BLOCK = 8 << 20  # bytes per write/read call

# Which limit each kind of result is measured against.
ANCHORS = {
    "memcpy": "memory copy into a preallocated buffer",
    "write": "sequential write + fsync",
    "read_cold": "sequential read, cold page cache",
    "read_cached": "sequential read, from the page cache",
}


def _fs_type(path: str) -> str:
    best, typ = "", ""
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _dev, mnt, t = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, typ = mnt, t
    except OSError:
        pass
    return typ


def disk_dir(base: str | None = None) -> str:
    """A fresh temporary folder on a real filesystem (the temp dir unless it is tmpfs)."""
    if base is None:
        base = tempfile.gettempdir()
        if _fs_type(base) in ("tmpfs", "ramfs"):
            base = "/var/tmp"
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="sp-bench-limits-", dir=base)


# ---------------------------------------------------------------- memory copy
def memcpy_once(src, dst) -> float:
    t = time.perf_counter()
    dst.copy_(src)
    return src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9


def measure_memcpy(nbytes: int, threads: int, repeats: int) -> list[float]:
    """GB/s of ``dst.copy_(src)`` between two preallocated ``nbytes`` buffers, torch on ``threads``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of dst's pages is not part of a copy into a reused buffer
        return [memcpy_once(src, dst) for _ in range(repeats)]
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------- disk
def _read_file(path: str) -> int:
    buf = bytearray(BLOCK)
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            k = os.readv(fd, [buf])
            if k <= 0:
                return n
            n += k
    finally:
        os.close(fd)


def _evict(paths: list[str]) -> str:
    """Make the next read of ``paths`` come from the device; returns how."""
    if C.drop_caches():
        return "drop_caches"
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    except (OSError, AttributeError):
        return "none"


def disk_once(root: str, nbytes: int, streams: int) -> dict:
    """Write ``nbytes`` over ``streams`` files (fsync each), read them back cold, then cached."""
    block = os.urandom(1 << 20) * (BLOCK >> 20)
    per = max(BLOCK, nbytes // streams // BLOCK * BLOCK)
    paths = [os.path.join(root, f"limit-{streams}-{i}.bin") for i in range(streams)]
    os.sync()
    tw = C.run_threads(C.write_file, [(p, per, block) for p in paths])
    total = per * streams
    how = _evict(paths)
    tr = C.run_threads(_read_file, [(p,) for p in paths])
    tc = C.run_threads(_read_file, [(p,) for p in paths])
    for p in paths:
        os.unlink(p)
    return {"bytes": total, "write_gbps": total / tw / 1e9, "read_cold_gbps": total / tr / 1e9,
            "read_cached_gbps": total / tc / 1e9, "evict": how}


# ---------------------------------------------------------------- all
def measure(nbytes: int = 1 << 30, repeats: int = 3, memcpy_bytes: int | None = None, root: str | None = None,
            log=print) -> dict[str, Any]:
    """Measure every limit; return the JSON-ready result (see the module docstring)."""
    t0 = time.perf_counter()
    mb = memcpy_bytes or min(nbytes, 512 << 20)
    out: dict[str, Any] = {"benchmark": "limits", "bytes": nbytes, "memcpy_bytes": mb, "repeats": repeats,
                           "machine": C.machine_info(), "variants": {}}
    var = out["variants"]
    for th in (1, 2):
        v = measure_memcpy(mb, th, repeats)
        var[f"memcpy_{th}t"] = {**C.summary(v), "values": v}
        log(f"# memcpy {th} thread(s): {C.fmt(var[f'memcpy_{th}t'], 1, 2)} GB/s")
    d = disk_dir(root)
    out["filesystem"] = _fs_type(d)
    try:
        for streams in (1, 2):
            runs = [disk_once(d, nbytes, streams) for _ in range(repeats)]
            for k in ("write", "read_cold", "read_cached"):
                vals = [r[f"{k}_gbps"] for r in runs]
                var[f"{k}_{streams}s"] = {**C.summary(vals), "values": vals}
            out.setdefault("evict", runs[0]["evict"])
            log(f"# {streams} stream(s), {runs[0]['bytes'] / 1e6:.0f} MB: write+fsync {C.fmt(var[f'write_{streams}s'], 1, 2)}, "
                f"read cold ({runs[0]['evict']}) {C.fmt(var[f'read_cold_{streams}s'], 1, 2)}, "
                f"cached {C.fmt(var[f'read_cached_{streams}s'], 1, 2)} GB/s")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    limits = {}
    for k, prefix in (("memcpy", "memcpy_"), ("write", "write_"), ("read_cold", "read_cold_"), ("read_cached", "read_cached_")):
        best = max((name for name in var if name.startswith(prefix)), key=lambda n: var[n]["median"])
        limits[k] = {"gbps": var[best]["median"], "variant": best, "what": ANCHORS[k]}
    out["limits"] = limits
    out["cold_reads"] = out.get("evict") in ("drop_caches", "fadvise")
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def load(path: str | None) -> dict | None:
    """The limits from a JSON written by this script (or by suite.py), else None."""
    if not path:
        return None
    import json

    with open(path) as f:
        d = json.load(f)
    return d if "limits" in d else d.get("parts", {}).get("limits")


def limit_gbps(limits: dict | None, kind: str) -> float | None:
    """The GB/s of limit ``kind`` (memcpy, write, read_cold, read_cached), or None."""
    if not limits:
        return None
    x = limits.get("limits", {}).get(kind)
    return x["gbps"] if x else None


def print_table(res: dict) -> None:
    print(f"\nMachine limits ({res['bytes'] / 1e6:.0f} MB files, memcpy of {res['memcpy_bytes'] / 1e6:.0f} MB, "
          f"{res['repeats']} repeats; cold reads by {res.get('evict')}), GB/s median [min, max]:")
    for name, s in res["variants"].items():
        print(f"  {name:<16} {C.fmt(s, 1, 2)}")
    print("Limits used as anchors (best variant's median):")
    for k, v in res["limits"].items():
        print(f"  {k:<12} {v['gbps']:6.2f} GB/s  ({v['variant']}: {v['what']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="bytes per disk measurement, in MiB (default 1024)")
    ap.add_argument("--memcpy-mb", type=int, default=None, help="buffer size of the copy measurement (default min(--mb, 512))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="512 MiB files")
    ap.add_argument("--dir", default=None, help="parent folder of the test files (default: the temp dir, if on disk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mb = 512 if args.quick and args.mb == 1024 else args.mb
    res = measure(mb << 20, args.repeats, (args.memcpy_mb << 20) if args.memcpy_mb else None, args.dir)
    res["command"] = "bench/limits.py " + " ".join(os.path.basename(a) if os.sep in a else a
                                                   for a in (sys.argv[1:] if argv is None else argv))
    print_table(res)
    if args.json:
        C.write_json(args.json, res)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
