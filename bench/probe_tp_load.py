"""Probe: where a cold FSDP2 4 -> TP 2 resharding load spends its time (shardpoint only).

Not a peer comparison (bench_load.py is): it saves the bench_load state
(TinyGPT dim 768, 5 layers, AdamW after two steps) from 4 FSDP2 ranks, then
loads it ``--loads`` times into TP on 2 ranks (``share_reads=False`` unless
``--share``), dropping the page cache before each load (root only), and
prints each rank's wall times, the median of the slower rank, the read
requests and bytes of the last load (``LocalStorage.stats``) and its phase
timings (``read`` sums over reader threads; ``verify`` and ``copy`` run on
the loading thread).

With ``--read-patterns N`` it first times plain cold reads of the saved
data files, N times each, interleaved: the files split between two reader
threads (as two ranks stream them), in 2.25 MiB requests (about one chunk)
or 256 KiB requests, with two threads per half reading alternate
2.25 MiB spans (two reader threads per rank), and as four streams (one per
saved file when there are four: two per rank).

    python bench/probe_tp_load.py
    python bench/probe_tp_load.py --loads 10 --no-verify
    python bench/probe_tp_load.py --read-patterns 5 --loads 0
    python bench/probe_tp_load.py --size 1.5gb --loads 4 --trace
    python bench/probe_tp_load.py --size 1.5gb --loads 5 --warm --profile
    python bench/probe_tp_load.py --size 1.5gb --loads 12 --replay 5
    python bench/probe_tp_load.py --size 1.5gb --loads 4 --replay 3 --replay-own --replay-threads 1 2

Each load also reports the process's CPU seconds (``cpu_user``,
``cpu_sys``) and the machine's idle, I/O-wait, interrupt, steal and busy
CPU seconds over the call (``host_*``, from /proc/stat): a cold load whose
CPUs sit in I/O wait is waiting on the device, one with no idle time is
bound by CPU or memory. ``--trace-dir`` keeps the last load's Chrome
traces; ``--profile`` saves rank 0's cProfile of its last load.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

CFG = dict(vocab=2048, dim=768, heads=12, layers=5, seq=16)


def save_job(rank: int, world: int, root: str, cfg: dict) -> None:
    import shardpoint as sp
    from shardpoint.testing import GPTConfig, batch, build, loss_of

    c = GPTConfig(**cfg)
    model, opt = build("fsdp2", c, seed=0)
    for i in range(2):
        x, y = batch(i, c, 4)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sp.save(root, {"model": model, "optimizer": opt})


def load_job(rank: int, world: int, root: str, cfg: dict, loads: int, share: bool, verify: bool, trace: bool = False,
             mmap_reads: bool | str = "auto", trace_dir: str | None = None, warm: bool = False, profile: bool = False,
             record: bool = False, alternate: tuple | None = None) -> list:
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.storage import LocalStorage
    from shardpoint.testing import GPTConfig, build

    model, opt = build("tp", GPTConfig(**cfg), seed=1)
    out = []
    for n in range(loads):
        gc.collect()
        if rank == 0 and not warm:
            C.drop_caches()
        dist.barrier()
        if alternate:  # an A/B switch read by code under test: load n gets value n mod k
            os.environ[alternate[0]] = alternate[1][n % len(alternate[1])]
        resident = _resident(root)  # what of the data files the page cache still holds: 0 when cold
        st = LocalStorage(root, mmap_reads=mmap_reads)
        spans: list = []
        if trace:
            _trace_reads(st, spans)
        log: list = []
        if record and n == loads - 1:
            _record_reads(st, log)
        rep = sp.LoadResult()
        cpu0, sys0 = resource.getrusage(resource.RUSAGE_SELF), _cpu_idle()
        prof = None
        if profile and rank == 0 and n == loads - 1:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        sp.load(st, {"model": model, "optimizer": opt}, report=rep, share_reads=share, verify=verify,
                trace_dir=trace_dir if n == loads - 1 else None)
        wall = time.perf_counter() - t
        if prof is not None:
            prof.disable()
            out_path = os.path.join(tempfile.gettempdir(), "probe_tp_load.prof")
            prof.dump_stats(out_path)
        cpu1, sys1 = resource.getrusage(resource.RUSAGE_SELF), _cpu_idle()
        phases = {k: round(v, 3) for k, v in rep.timings.items()}
        # this process's CPU seconds (all threads), and the machine's idle and I/O-wait seconds, over the call
        phases["resident_before"] = round(resident, 3)
        phases["cpu_user"] = round(cpu1.ru_utime - cpu0.ru_utime, 3)
        phases["cpu_sys"] = round(cpu1.ru_stime - cpu0.ru_stime, 3)
        phases["host_idle"], phases["host_iowait"], phases["host_irq"], phases["host_steal"], phases["host_busy"] = (
            round(b - a, 3) for a, b in zip(sys0, sys1))
        if spans:  # when the data reads started and ended, from the call
            phases["first_read"] = round(min(a for a, _ in spans) - t, 3)
            phases["last_read_end"] = round(max(b for _, b in spans) - t, 3)
        out.append((round(wall, 3), st.stats.reads, st.stats.bytes_read, phases, log))
        st.close()  # unmap: mapped pages would survive the next drop of the page cache
    return out


def _resident(root: str) -> float:
    """Fraction of the data files' pages in the page cache (mincore), over all of them."""
    import mmap

    from shardpoint.storage.local import resident_fraction

    have = total = 0
    data = os.path.join(root, "data")
    for name in sorted(os.listdir(data)):
        with open(os.path.join(data, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
                have += resident_fraction(mm, 0, size) * size
                total += size
    return have / total if total else 0.0


def _cpu_idle() -> tuple[float, ...]:
    """The machine's idle, I/O-wait, interrupt, steal and user+system seconds so far, summed over its CPUs (/proc/stat)."""
    with open("/proc/stat") as f:
        v = f.readline().split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(v[4]) / tick, int(v[5]) / tick, (int(v[6]) + int(v[7])) / tick, int(v[8]) / tick, (int(v[1]) + int(v[3])) / tick


def _record_reads(st, log: list) -> None:
    """Log every data-file read as ``(kind, file, offset, length)``, in the order asked.

    ``kind`` is ``read``, ``map`` (a span mapped by the loading thread) or
    ``populate`` (a mapped piece brought in by a reader thread);
    :func:`_disk_order` keeps what the disk was asked for.
    """
    many, mapr, pop = st.readinto_many, st.map_range, st.populate  # LocalStorage.readinto goes through readinto_many

    def readinto_many(name, parts):
        parts = list(parts)
        log.extend(("read", name, off, len(mv)) for off, mv in parts)
        return many(name, parts)

    def map_range(name, offset, length, count=None):
        got = mapr(name, offset, length, count)
        if got is not None:
            log.append(("map", name, offset, length))
        return got

    def populate(name, offset, length):
        ok = pop(name, offset, length)
        if ok:
            log.append(("populate", name, offset, length))
        return ok

    st.readinto_many, st.map_range, st.populate = readinto_many, map_range, populate


def _disk_order(log: list) -> list:
    """``(file, offset, length)`` of a recorded load, in the order its reads reached the disk.

    Where mapped pieces were populated, the disk saw them then, not when
    their spans were mapped; elsewhere page faults read a mapped span as it
    was touched, which its mapping's place in the log approximates.
    """
    populated = any(k == "populate" for k, *_ in log)
    return [(f, o, n) for k, f, o, n in log if k == "read" or k == ("populate" if populated else "map")]


def _replay_rank(root: str, log: list, threads: int, barrier, out) -> None:
    """One rank's replay, in its own process: ``threads`` threads pull its ranges in order."""
    import threading

    fds = {name: os.open(os.path.join(root, name), os.O_RDONLY) for name in {n for n, _o, _l in log}}
    it, lock = iter(log), threading.Lock()

    def worker() -> None:
        buf = bytearray(8 << 20)
        while True:
            with lock:
                x = next(it, None)
            if x is None:
                return
            name, off, n = x
            if n > len(buf):
                buf = bytearray(n)
            mv = memoryview(buf)
            got = 0
            while got < n:
                k = os.preadv(fds[name], [mv[got:n]], off + got)
                if k <= 0:
                    break
                got += k

    barrier.wait()
    out.put(C.run_threads(worker, [()] * threads))
    for fd in fds.values():
        os.close(fd)


def replay(root: str, logs: list, repeats: int, threads: int = 2) -> None:
    """Cold ``pread``s of exactly what each rank's load asked for, in its order, with nothing else running.

    One process per rank, with ``threads`` threads pulling that rank's
    logged ranges in order into a scratch buffer: the time the device needs
    for the load's own access pattern, without the load's CPU work
    (hashing, copying, planning) competing with it.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    total = sum(os.path.getsize(os.path.join(root, "data", f)) for f in os.listdir(os.path.join(root, "data")) if f.endswith(".bin"))
    walls = []
    for _ in range(repeats):
        if not C.drop_caches():
            print("# cannot drop the page cache (not root): no replay")
            return
        barrier, out = ctx.Barrier(len(logs)), ctx.Queue()
        ps = [ctx.Process(target=_replay_rank, args=(root, log, threads, barrier, out)) for log in logs]
        for p in ps:
            p.start()
        walls.append(max(out.get() for _ in ps))
        for p in ps:
            p.join()
    asked = sum(n for log in logs for _f, _o, n in log)
    print(f"replay of the last load's reads ({len(logs)} ranks x {threads} threads, {asked / 1e6:.0f} MB asked, "
          f"{total / 1e6:.0f} MB of data files): {C.fmt(C.summary(walls), 1, 3)} s cold, "
          f"{total / statistics.median(walls) / 1e9:.2f} GB/s of the data files")


def _trace_reads(st, spans: list) -> None:
    """Record (start, end) of every data-file read call on this storage object."""
    for name in ("readinto", "readinto_many"):
        orig = getattr(st, name)

        def timed(path, *a, _orig=orig):
            t0 = time.perf_counter()
            try:
                return _orig(path, *a)
            finally:
                if path.startswith("data"):
                    spans.append((t0, time.perf_counter()))

        setattr(st, name, timed)


SPAN = 9 << 18  # 2.25 MiB, about one saved chunk here


def _read_half(paths: list, threads: int, piece: int) -> None:
    """Read ``paths`` in order, SPAN by SPAN, ``threads`` spans at a time, in requests of ``piece`` bytes."""
    from concurrent.futures import ThreadPoolExecutor

    fds = [os.open(p, os.O_RDONLY) for p in paths]
    jobs = [(fd, o, min(SPAN, os.fstat(fd).st_size - o)) for fd in fds for o in range(0, os.fstat(fd).st_size, SPAN)]

    def one(job) -> None:
        fd, off, n = job
        mv = memoryview(bytearray(n))
        got = 0
        while got < n:
            got += os.preadv(fd, [mv[got : got + piece]], off + got)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    finally:
        for fd in fds:
            os.close(fd)


def read_patterns(root: str, repeats: int) -> None:
    files = sorted((os.path.join(root, "data", f) for f in os.listdir(os.path.join(root, "data")) if f.endswith(".bin")),
                   key=lambda p: p[-10:])  # by writer rank (file names end in -rNNNNN.bin)
    total = sum(os.path.getsize(f) for f in files)

    def split(n: int) -> list:
        return [files[i * len(files) // n : (i + 1) * len(files) // n] for i in range(n)]

    # name: (streams, threads per stream, request size); a stream reads its share of the files in order
    patterns = {
        "2 streams, 1 thread each, 2.25 MiB requests": (2, 1, SPAN),
        "2 streams, 1 thread each, 256 KiB requests": (2, 1, 256 << 10),
        "2 streams, 2 threads each, 2.25 MiB requests": (2, 2, SPAN),
        "4 streams, 1 thread each, 2.25 MiB requests": (4, 1, SPAN),
        "4 streams, 1 thread each, 256 KiB requests": (4, 1, 256 << 10),
    }
    got: dict = {k: [] for k in patterns}
    for _ in range(repeats):
        for name, (streams, threads, piece) in patterns.items():
            if not C.drop_caches():
                print("# cannot drop the page cache (not root): no read patterns")
                return
            got[name].append(total / C.run_threads(_read_half, [(h, threads, piece) for h in split(streams)]) / 1e9)
    for name, v in got.items():
        print(f"{name}: {C.fmt(C.summary(v), 1, 2)} GB/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=6)
    ap.add_argument("--share", action="store_true", help="share_reads=True")
    ap.add_argument("--no-verify", action="store_true", help="verify=False")
    ap.add_argument("--no-mmap", action="store_true", help="LocalStorage(mmap_reads=False): read every span into a buffer")
    ap.add_argument("--trace", action="store_true", help="report when the data reads start and end in each load")
    ap.add_argument("--replay", type=int, default=0, metavar="N",
                    help="then replay the last load's reads N times, cold, with plain preads (the device's time for that pattern)")
    ap.add_argument("--replay-own", action="store_true",
                    help="also replay each rank's reads of its own part of the files only, as asked and in file order")
    ap.add_argument("--replay-threads", type=int, nargs="+", default=[2], metavar="T",
                    help="reader threads per rank in the replay (several: one replay each)")
    ap.add_argument("--warm", action="store_true", help="keep the page cache between loads")
    ap.add_argument("--profile", action="store_true", help="profile rank 0's last load (cProfile; saved as probe_tp_load.prof in the temp folder)")
    ap.add_argument("--trace-dir", default=None, help="write the last load's Chrome traces (one per rank) here")
    ap.add_argument("--size", default=None, help="a suite state size (100mb, 1.5gb) instead of the bench_load state")
    ap.add_argument("--alternate-env", default=None, metavar="NAME=A,B",
                    help="set environment variable NAME to A, B, ... in turn, one value per load, and report each value's loads")
    ap.add_argument("--read-patterns", type=int, default=0, metavar="N", help="time plain cold reads of the data files first, N times")
    args = ap.parse_args(argv)
    C.setup_env()
    from shardpoint.testing import launch

    tmp = tempfile.mkdtemp(prefix="sp-probe-")
    try:
        return _run(args, os.path.join(tmp, "ck"), launch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args, root: str, launch) -> int:
    cfg = C.size_cfg(args.size) if args.size else dict(CFG)
    launch(4, "probe_tp_load:save_job", {"root": root, "cfg": cfg})
    if args.read_patterns:
        read_patterns(root, args.read_patterns)
    if args.loads <= 0:
        return 0
    alt = None
    if args.alternate_env:
        name, _, vals = args.alternate_env.partition("=")
        alt = (name, vals.split(","))
    ranks = launch(2, "probe_tp_load:load_job", {"root": root, "cfg": cfg, "loads": args.loads, "share": args.share, "verify": not args.no_verify,
                                                         "trace": args.trace, "mmap_reads": False if args.no_mmap else "auto", "warm": args.warm, "record": bool(args.replay), "profile": args.profile,
                                                         "trace_dir": os.path.abspath(args.trace_dir) if args.trace_dir else None,
                                                         "alternate": alt})
    for rank, runs in enumerate(ranks):
        _w, reqs, nbytes, phases, _log = runs[-1]
        print(f"rank {rank}: wall s {[w for w, *_ in runs]}")
        print(f"  last load: {reqs} read requests, {nbytes / 1e6:.1f} MB; phases {phases}")
    slowest = [max(r[i][0] for r in ranks) for i in range(args.loads)]
    print(f"slower rank: median {statistics.median(slowest):.3f} s [{min(slowest):.3f}, {max(slowest):.3f}]")
    if len(slowest) > 3:  # the first loads also fault in the optimizer state and the mappings' page tables
        rest = slowest[2:]
        print(f"slower rank, loads 3 on: median {statistics.median(rest):.3f} s [{min(rest):.3f}, {max(rest):.3f}]")
    if alt:  # loads 3 on, by value
        for k, v in enumerate(alt[1]):
            ws = [w for i, w in enumerate(slowest) if i >= 2 and i % len(alt[1]) == k]
            if ws:
                print(f"{alt[0]}={v}: median {statistics.median(ws):.3f} s [{min(ws):.3f}, {max(ws):.3f}] over {len(ws)} loads")
    if args.replay:
        logs = [_disk_order(runs[-1][4]) for runs in ranks]
        variants = {"as asked": logs}
        if args.replay_own:
            # Rank k's own part: the files written by saving ranks 2k and 2k+1 (4 saving ranks, 2 loading).
            files = sorted({n for log in logs for n, _o, _l in log}, key=lambda n: n[-10:])
            per = max(1, len(files) // len(logs))
            own = [[x for x in log if x[0] in files[k * per : (k + 1) * per]] for k, log in enumerate(logs)]
            variants["own part only, as asked"] = own
            variants["own part only, in file order"] = [sorted(log, key=lambda x: (x[0][-10:], x[1])) for log in own]
        for label, lg in variants.items():
            for th in args.replay_threads:
                print(f"{label}: ", end="")
                replay(root, lg, args.replay, th)
    return 0


if __name__ == "__main__":
    sys.exit(main())
