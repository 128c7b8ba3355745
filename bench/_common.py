"""Helpers shared by bench/bench_async.py and bench/bench_load.py.

Both benchmarks launch their ranks with :func:`shardpoint.testing.launch`
(forked gloo ranks, one torch thread each) and import this module inside the
ranks, so everything here must work in a rank process as well as in the parent.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)


def setup_env() -> None:
    """Make ``bench/`` importable in the ranks and set the peers' required environment."""
    for p in (REPO, BENCH_DIR):
        if p not in sys.path:
            sys.path.insert(0, p)
    parts = [BENCH_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # ByteCheckpoint 0.0.2 stores extra state with pickles; torch >= 2.6 refuses them by default.
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    os.chdir(REPO)  # launch() puts the working directory on the ranks' PYTHONPATH


# ------------------------------------------------------------------ workload sizes
# The two sizes of the benchmark suite: TinyGPT + AdamW after one step holds
# 12 bytes of state per parameter (fp32 weight, exp_avg, exp_avg_sq) plus the step counts.
SIZES: dict[str, dict] = {
    "100mb": dict(vocab=1024, dim=384, heads=6, layers=4, seq=16),  # 7.9 M parameters, 94.6 MB of state
    "1.5gb": dict(vocab=4096, dim=1024, heads=16, layers=9, seq=16),  # 121.7 M parameters, 1.46 GB of state
}


def size_cfg(name: str) -> dict:
    """The TinyGPT config of a suite size (``100mb`` or ``1.5gb``)."""
    try:
        return dict(SIZES[name.lower()])
    except KeyError:
        raise ValueError(f"unknown size {name!r}; choose from {', '.join(SIZES)}") from None


# ------------------------------------------------------------------ statistics
def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and count of ``values`` (None when empty)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def fmt(s: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    """``median [min, max]`` of a :func:`summary`."""
    if not s or s.get("median") is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'] * scale)} [{f.format(s['min'] * scale)}, {f.format(s['max'] * scale)}]"


# ------------------------------------------------------------------ machine state
def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def wait_quiet(max_load: float, timeout: float, log=print) -> dict:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``timeout`` s)."""
    t0 = time.monotonic()
    la = load_average()
    while la[0] >= max_load and time.monotonic() - t0 < timeout:
        log(f"# waiting for a quiet machine: load average {la[0]:.2f} >= {max_load}")
        time.sleep(20)
        la = load_average()
    return {"load_average_at_start": la, "waited_s": round(time.monotonic() - t0, 1), "quiet": la[0] < max_load}


def machine_info() -> dict:
    import psutil
    import torch

    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (needs root); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_file(path: str, nbytes: int, block: bytes) -> None:
    """Write ``nbytes`` to ``path``, ``block`` after ``block`` (the last one cut short), then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(block)
        for off in range(0, nbytes, len(block)):
            os.write(fd, mv[: min(len(block), nbytes - off)])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_scratch(path: str, nbytes: int, block: int = 16 << 20) -> str:
    """Write ``nbytes`` of incompressible bytes to ``path`` (once) for :func:`prime_page_memory`."""
    if not (os.path.exists(path) and os.path.getsize(path) >= nbytes):
        write_file(path, nbytes, os.urandom(block))
    return path


def read_threaded(path: str, offset: int, length: int, threads: int = 4, block: int = 8 << 20) -> float:
    """Read ``[offset, offset + length)`` of ``path`` into scratch buffers, split over ``threads``; seconds."""
    fd = os.open(path, os.O_RDONLY)
    per = -(-length // threads)

    def work(i: int) -> None:
        buf = bytearray(block)
        off, end = offset + i * per, min(offset + length, offset + (i + 1) * per)
        while off < end:
            n = os.preadv(fd, [memoryview(buf)[: min(block, end - off)]], off)
            if n <= 0:
                return
            off += n

    try:
        return run_threads(work, [(i,) for i in range(threads)])
    finally:
        os.close(fd)


def run_threads(fn, args_list) -> float:
    """Run ``fn(*args)`` for each ``args`` on its own thread; the wall seconds until all are done."""
    ts = [threading.Thread(target=fn, args=a) for a in args_list]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return time.perf_counter() - t


def prime_page_memory(scratch: str, threads: int = 4, block: int = 8 << 20) -> bool:
    """Fill the page cache with ``scratch`` and drop it again (root only; False when not allowed).

    A diagnostic for ``bench_load.py --prime``. On a VM whose balloon
    reports free pages to the host (virtio free page reporting, as on the
    benchmark machine), a cold read into memory the guest has not used
    recently runs at a third of the rate of one into memory freed just
    before (1.1 against 3.5 GB/s, docs/benchmarks.md), so a cold
    load's time depends on how much memory the load before it freed.
    Reading and dropping scratch data right before a load hands it that
    much recently used memory. It is not a neutral fix: at three times the
    checkpoint's size it steadied shardpoint's cold loads but slowed DCP's
    loads that followed shardpoint's (docs/benchmarks.md, "The resharding load"), so
    it is off unless asked for.
    """
    if not drop_caches():
        return False
    read_threaded(scratch, 0, os.path.getsize(scratch), threads, block)
    return drop_caches()


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar: every byte through read(2) and friends,
    page-cache hits and sockets included; read_bytes: bytes fetched from the block device)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def dir_bytes(path: str) -> int:
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


# ------------------------------------------------------------------ memory
class RssSampler:
    """Samples this process's RSS (and its children's) on a thread; keeps the high-water marks.

    ``peak`` is the rank process alone; ``peak_tree`` adds live child processes
    (DCP's process executor and ByteCheckpoint's helpers run in children).
    ``ru_maxrss`` from getrusage is reported as a cross-check.
    """

    def __init__(self, interval: float = 0.01):
        import psutil

        self._p = psutil.Process()
        self.interval = interval
        self.peak = 0
        self.peak_tree = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._children: list = []
        self._last_child_scan = 0.0

    def rss(self) -> int:
        return self._p.memory_info().rss

    def _sample(self) -> None:
        own = self._p.memory_info().rss
        now = time.monotonic()
        if now - self._last_child_scan > 0.5:
            try:
                self._children = self._p.children(recursive=True)
            except Exception:  # noqa: BLE001
                self._children = []
            self._last_child_scan = now
        kids = 0
        for c in self._children:
            try:
                kids += c.memory_info().rss
            except Exception:  # noqa: BLE001 - a child that exited
                pass
        self.peak = max(self.peak, own)
        self.peak_tree = max(self.peak_tree, own + kids)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> "RssSampler":
        self._sample()
        self._t.start()
        return self

    def reset(self) -> None:
        self.peak = self.peak_tree = 0
        self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self._sample()
        return self.read()

    def read(self) -> dict:
        import resource

        return {
            "peak_rss": self.peak,
            "peak_rss_with_children": self.peak_tree,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


class PeakRss:
    """This process's peak RSS over a stretch of code, from the kernel's own high-water mark.

    ``reset()`` writes 5 to ``/proc/self/clear_refs`` (Linux 4.0+), which
    sets the high-water mark (``VmHWM``) back to the current RSS; ``peak()``
    reads it. Nothing runs while the measured code does, unlike a sampling
    thread (a 5 ms sampler cost a cold 1.46 GB load about 0.03 s). Where the
    reset is refused, ``available`` is False and the caller samples instead.
    """

    def __init__(self) -> None:
        self.available = self.reset()

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {field} in /proc/self/status")

    def reset(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def rss(self) -> int:
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")


# ------------------------------------------------------------------ state fingerprints
def _local(t):
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_hash(t) -> str:
    import xxhash

    t = _local(t).contiguous()
    return xxhash.xxh3_64_hexdigest(t.reshape(-1).view(__import__("torch").uint8).numpy())


def local_hashes(model, opt) -> dict[str, str]:
    """A fingerprint (xxh3 of the raw bytes) of every local shard of model and optimizer state.

    Bit-exact comparison without holding a copy of the state in memory.
    """
    from torch import nn

    m = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {f"model.{k}": tensor_hash(v) for k, v in m.state_dict().items() if hasattr(v, "detach")}
    names = {id(p): n for n, p in m.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                if hasattr(v, "detach"):
                    out[f"opt.{names[id(p)]}.{k}"] = tensor_hash(v)
    return out


def full_hashes(model, opt) -> dict[str, str]:
    """Fingerprints of the unsharded logical tensors (a collective: all-gathers everything)."""
    import xxhash
    import torch

    from shardpoint.testing import full_state

    out = {}
    for k, v in full_state(model, opt).items():
        out[k] = xxhash.xxh3_64_hexdigest(v.contiguous().reshape(-1).view(torch.uint8).numpy())
    return out


def diff_hashes(ref: dict, got: dict) -> list[str]:
    keys = set(ref) | set(got)
    return sorted(k for k in keys if ref.get(k) != got.get(k))


def local_state_bytes(model, opt) -> int:
    """Bytes of this rank's local model and optimizer tensors (what a load must fill)."""
    from torch import nn

    m = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    n = 0
    for v in m.state_dict().values():
        if hasattr(v, "detach"):
            t = _local(v)
            n += t.numel() * t.element_size()
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "detach"):
                t = _local(v)
                n += t.numel() * t.element_size()
    return n


# ------------------------------------------------------------------ peers
def dcp_state(model, opt) -> dict:
    """The state dict a DCP user saves and loads: get_state_dict of model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_apply(model, opt, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def bytecheckpoint_status() -> dict:
    """Whether ByteCheckpoint imports here, and why not."""
    try:
        import bytecheckpoint  # noqa: F401
        from bytecheckpoint.version import __version__ as v  # type: ignore

        return {"available": True, "version": v}
    except Exception as e:  # noqa: BLE001
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}


def _bcp_serve_loopback(world_size, conn):  # runs in ByteCheckpoint's spawned helper process

    import grpc
    from bytecheckpoint.utilities.server import report_service_pb2_grpc, server_lib

    async def serve_local(servicer, async_addr):
        server = grpc.aio.server(options=server_lib._GRPC_OPTIONS)
        report_service_pb2_grpc.add_ByteCheckpointReportServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async_addr.obj = f"127.0.0.1:{port}"
        async_addr.e.set()
        await server.wait_for_termination()

    server_lib.async_serve = serve_local
    server_lib._serve_in_loop(world_size, conn)


def bcp_loopback() -> None:
    """Keep ByteCheckpoint's rank-0 gRPC helper on 127.0.0.1 (it binds every interface by default)."""
    import multiprocessing

    from bytecheckpoint.utilities.server import server_lib

    def start(world_size: int):
        parent, child = multiprocessing.Pipe()
        p = multiprocessing.get_context("spawn").Process(target=_bcp_serve_loopback, args=(world_size, child), daemon=True)
        p.start()
        return parent.recv()

    server_lib.start_server_in_new_process = start


# ------------------------------------------------------------------ output
def failure(msg: str, limit: int = 1500) -> str:
    """A failed run's message for the results: its first line, the lines that say why, and no machine paths.

    A launcher error carries the ranks' stderr, with tracebacks full of absolute
    paths; what matters is the first line and any signal or exception line
    (a rank killed by SIGKILL on a 24 GiB machine is usually the OOM killer).
    """
    lines = msg.splitlines()
    keep = lines[:1] + [ln for ln in lines[1:] if "terminated with signal" in ln or "Error:" in ln or "timed out" in ln]
    out = "\n".join(dict.fromkeys(ln.strip() for ln in keep if ln.strip()))
    return re.sub(r"(?:/[\w.+-]+)+/([\w.+-]+)", r"\1", out)[:limit]


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
