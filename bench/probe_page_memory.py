"""Probe: how fast a cold read is, depending on when the memory it lands in was last used.

Not a peer comparison. On a VM whose balloon reports free pages to the host
(virtio free page reporting), memory the guest freed a few seconds ago is
handed back to the host, and a later read that fills the page cache with it
waits for the host to fault it in again. Every cold benchmark here drops
the page cache and then reads, so its speed depends on what the machine did
just before. This probe reads the same data cold (``--gb`` GB of a scratch
file, four threads, 8 MiB requests, buffered) in four conditions, one after
the other in each round:

- ``just freed``: right after the previous read's pages were dropped;
- ``idle``: after ``--idle`` seconds with nothing running;
- ``after other data``: idle, then as much other data read and kept cached,
  so the read lands in memory that was not used recently;
- ``primed``: idle, then the other data read and dropped right before.

It prints the median rate of each condition and its ratio to ``just
freed``, and whether the machine has a balloon that reports free pages.
Root only (it drops the page cache).

    python bench/probe_page_memory.py
    python bench/probe_page_memory.py --gb 1.5 --rounds 3 --idle 5
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

GIB = 1 << 30


def free_page_reporting() -> str:
    """'yes', 'no' or 'unknown': whether a virtio balloon here offers free page reporting."""
    found = "unknown"
    for dev in glob.glob("/sys/bus/virtio/devices/*"):
        try:
            with open(os.path.join(dev, "device")) as f:
                if int(f.read().strip(), 16) != 5:  # 5: the balloon
                    continue
            with open(os.path.join(dev, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        return "yes" if len(bits) > 5 and bits[5] == "1" else "no"  # feature 5: VIRTIO_BALLOON_F_REPORTING
    return found


def read(path: str, offset: int, length: int) -> float:
    """Read ``[offset, offset + length)`` of ``path`` on four threads, 8 MiB requests; GB/s."""
    return length / C.read_threaded(path, offset, length) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.5, help="GB read per measurement (the scratch file holds twice this)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idling before the idle, other-data and primed reads")
    ap.add_argument("--root", default=None, help="where the scratch file goes (default: a temporary folder)")
    args = ap.parse_args(argv)
    if not C.drop_caches():
        print("# cannot drop the page cache (not root): nothing measured")
        return 1
    root = args.root or tempfile.mkdtemp(prefix="sp-probe-mem-")
    n = int(args.gb * GIB) // (1 << 20) * (1 << 20)
    path = C.write_scratch(os.path.join(root, "scratch.bin"), 2 * n)
    a, b = 0, n  # the measured data, and the other data
    print(f"# free page reporting: {free_page_reporting()}; {n / 1e9:.2f} GB per read, {args.rounds} rounds, idle {args.idle} s")
    rates: dict[str, list[float]] = {k: [] for k in ("just freed", "idle", "after other data", "primed")}
    try:
        read(path, a, n)  # so that the first "just freed" read follows a read like every later one
        for r in range(args.rounds):
            C.drop_caches()
            rates["just freed"].append(read(path, a, n))
            C.drop_caches()
            time.sleep(args.idle)
            rates["idle"].append(read(path, a, n))
            C.drop_caches()
            time.sleep(args.idle)
            read(path, b, n)
            rates["after other data"].append(read(path, a, n))
            C.drop_caches()
            time.sleep(args.idle)
            read(path, b, n)
            C.drop_caches()
            rates["primed"].append(read(path, a, n))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()) + " GB/s", flush=True)
    finally:
        C.drop_caches()
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(rates["just freed"])
    for k, v in rates.items():
        m = statistics.median(v)
        print(f"{k:17s} {m:.2f} GB/s [{min(v):.2f}, {max(v):.2f}]  {m / base:.2f}x of just freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
