"""Probe: the memory traffic of a verified resharding read, ``pread`` into a buffer against ``mmap``.

Not a peer comparison. It models the part of a FSDP2 4 -> TP 2 load where
both TP ranks need half of every row of the same row-sharded chunks: each
of two processes walks one file in checksum blocks, hashes every block
(xxh3_64, as verification must) and copies its half of each row into a
destination array. Two ways to get at the bytes:

- ``pread``: ``os.preadv`` into one reused block buffer (what the local
  backend does today): the kernel copies every byte once more;
- ``mmap``: hash and copy straight from a read-only mapping of the file
  (``MADV_SEQUENTIAL``, ``MADV_WILLNEED`` per block ahead), no extra copy.

Each pattern runs cold (page cache dropped first; root only) and warm, and
prints the slower process's seconds, median [min, max].

    python bench/probe_mmap.py --mb 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ROW = 1024  # fp32 elements per row: 4 KiB rows, as dim 1024
BLOCK = 4 << 20  # the checksum block


def _walk(path: str, half: int, how: str, out) -> None:
    size = os.path.getsize(path)
    rows = size // (ROW * 4)
    dst = np.empty((rows, ROW // 2), dtype=np.float32)
    dst.fill(0)  # the destination exists before a load, as model tensors do
    lo, hi = half * ROW // 2, (half + 1) * ROW // 2
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        if how == "pread":
            buf = np.empty(BLOCK, dtype=np.uint8)
            for b in range(0, size, BLOCK):
                n = min(BLOCK, size - b)
                got = os.preadv(fd, [memoryview(buf)[:n]], b)
                assert got == n
                xxhash.xxh3_64_intdigest(memoryview(buf)[:n])
                r0 = b // (ROW * 4)
                dst[r0 : r0 + n // (ROW * 4)] = buf[:n].view(np.float32).reshape(-1, ROW)[:, lo:hi]
        else:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            mm.madvise(mmap.MADV_SEQUENTIAL)
            arr = np.frombuffer(mm, dtype=np.uint8)
            ahead = 4 * BLOCK
            for b in range(0, size, BLOCK):
                n = min(BLOCK, size - b)
                if b + ahead < size:
                    mm.madvise(mmap.MADV_WILLNEED, b + ahead, min(BLOCK, size - b - ahead))
                view = arr[b : b + n]
                xxhash.xxh3_64_intdigest(view)
                r0 = b // (ROW * 4)
                dst[r0 : r0 + n // (ROW * 4)] = view.view(np.float32).reshape(-1, ROW)[:, lo:hi]
                del view
            del arr
            mm.close()
    finally:
        os.close(fd)
    out.put(time.perf_counter() - t)


def _pair(path: str, how: str) -> float:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=_walk, args=(path, h, how, q)) for h in (0, 1)]
    for p in ps:
        p.start()
    times = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return max(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sp-probe-mmap-", dir=os.environ.get("SP_BENCH_DIR"))
    try:
        path = os.path.join(tmp, "data.bin")
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(args.mb // 64):
                f.write(rng.standard_normal((64 << 20) // 4, dtype=np.float32).tobytes())
            f.flush()
            os.fsync(f.fileno())
        res: dict = {}
        for _ in range(args.repeats):
            for how in ("pread", "mmap"):
                for state in ("cold", "warm"):
                    if state == "cold" and not C.drop_caches():
                        continue
                    if state == "warm":
                        _pair(path, "pread")  # make sure every page is cached
                    res.setdefault(f"{how} {state}", []).append(_pair(path, how))
        print(f"# {args.mb} MB, two processes each hash every {BLOCK >> 20} MiB block and copy half of every "
              f"{ROW * 4} B row; slower process, s, median [min, max] of {args.repeats}")
        for k, v in res.items():
            print(f"{k:12s} {C.fmt(C.summary(v), 1, 3)} s  ({args.mb / 1e3 * 1.048576 / statistics.median(v):.2f} GB/s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
