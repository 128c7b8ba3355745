"""One process on one accelerator: shardpoint against PyTorch DCP on the same state, in one run.

The state is a stack of ``--layers`` Linear ``--width`` x ``--width`` layers
(with biases) and their AdamW state after one step (weights, ``exp_avg``,
``exp_avg_sq``: 12 bytes per parameter; 2.42 GB by default). A training step
is forward, backward and ``optimizer.step()`` on a batch sized so that one
step takes about ``--step-ms`` milliseconds. Files go under ``--dir``
(``/dev/shm`` by default), so storage is memory and the figures show the
engines, not a disk.

It measures, for shardpoint and for DCP on the same tensors:

- **copy limit**: one device-to-host copy of the whole state into
  preallocated pinned memory (and host-to-device back), timed in this run:
  the bound any snapshot or load has to meet;
- **sync save** (``sp.save`` / ``dcp.save``) and **load** (``sp.load`` /
  ``dcp.load``) into the live tensors: seconds and GB/s, median of
  ``--repeats``; every load is checked bit for bit;
- **async saves in a training loop**: windows of ``--window`` steps, a
  checkpoint starting every other window, in the middle of it, with the
  device's queue as the steps before left it (not emptied first). The
  *stall* is the time the save call blocked the loop (plus any wait for the
  previous save); the *time lost* is the checkpoint window's wall time
  minus the mean of its two neighbours without one, each neighbour timed
  only once the previous checkpoint is durable (a write still running would
  slow the baseline); *durable* is from the call until the checkpoint is
  committed. Modes: shardpoint eager, shardpoint lazy, DCP ``async_save``
  with its defaults, and DCP ``async_save`` with
  ``DefaultStager(StagingOptions(True, True, True, True))`` (pinned, shared
  memory, asynchronous staging, non-blocking copies) and cached save plans.
  The first checkpoint of each mode is a warm-up and is left out of the
  medians; a last one, outside the measured windows, is loaded back and
  compared bit for bit with a copy taken at its call;
- **pinned memory**: the peak and the end-of-mode bytes held by PyTorch's
  pinned host allocator (its own statistics, reset before each mode; memory
  pinned outside that allocator is not in them), and, for shardpoint, which
  on CUDA registers its own staging memory outside that allocator, the
  bytes the saver holds and the peak of its registered memory;
- **device checks** (CUDA only), bit for bit: a save called on a side
  stream, a state spread over several GPUs of the process (where there are
  several), and a graph captured in global mode on the training thread
  while an eager and a lazy save are in flight.

Ratios are to DCP and to the copy limit measured above. The run ends with
one table.

    PYTHONPATH=. python bench/bench_gpu.py             # the default: 2.42 GB, about 2 minutes on an H200
    PYTHONPATH=. python bench/bench_gpu.py --small     # small sizes: any machine, CPU included
    PYTHONPATH=. python bench/bench_gpu.py --dry-run   # the CPU-side logic on a tiny state, in seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardpoint as sp
from shardpoint.device import empty_host_cache, host_stats


def _reset_pinned_peak() -> None:
    """Empty PyTorch's pinned cache and reset its peak, so that the next mode's figures are its own."""
    if torch.cuda.is_available():
        empty_host_cache()
        reset = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
        if reset is not None:
            reset()


def _pinned_stats() -> tuple[int | None, int | None]:
    """(peak, current) bytes held by PyTorch's pinned host allocator, from its own statistics; None where absent."""
    stats_fn = getattr(torch.cuda.memory, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats_fn is None:
        return None, None
    stats = stats_fn()
    cur = host_stats()
    return stats.get("allocated_bytes.peak"), None if cur is None else cur["held"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def _median(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def build(args, dev: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def make_step(model, opt, dev, batch: int):
    x = torch.randn(batch, model[0].in_features, device=dev)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def calibrate(model, opt, dev, args):
    """A batch whose step takes about ``--step-ms``; returns (step function, seconds per step)."""
    batch = 64
    for _ in range(6):
        step = make_step(model, opt, dev, batch)
        step()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        _sync(dev)
        per = (time.perf_counter() - t0) / 3
        want = args.step_ms / 1000
        if abs(per - want) < 0.25 * want or batch >= 16384 and per < want or batch <= 1 and per > want:
            return step, per
        batch = max(1, min(16384, int(batch * want / max(per, 1e-6))))
    return step, per


def tensors_of(model, opt) -> list[torch.Tensor]:
    out = [p.data for p in model.parameters()]
    for s in opt.state.values():
        out.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return out


def dcp_state(model, opt) -> dict:
    """The same tensors for DCP: model weights and the optimizer's tensors by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            optim[f"{names[id(p)]}.{k}"] = v
    return {"model": model.state_dict(), "optim": optim}


def copy_limit(ts, dev):
    """Seconds of one device-to-host and one host-to-device copy of ``ts`` through pinned memory."""
    if dev.type == "cpu":
        bufs = [torch.empty_like(t) for t in ts]
        for b, t in zip(bufs, ts):  # fault the pages in first
            b.copy_(t)
        t0 = time.perf_counter()
        for b, t in zip(bufs, ts):
            b.copy_(t)
        d2h = time.perf_counter() - t0
        return d2h, d2h, 0
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in ts]
    for b, t in zip(bufs, ts):
        b.copy_(t, non_blocking=True)
    _sync(dev)
    t0 = time.perf_counter()
    for b, t in zip(bufs, ts):
        b.copy_(t, non_blocking=True)
    _sync(dev)
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b, t in zip(bufs, ts):
        t.copy_(b, non_blocking=True)
    _sync(dev)
    h2d = time.perf_counter() - t0
    return d2h, h2d, sum(b.numel() * b.element_size() for b in bufs)


def scramble(ts) -> None:
    """Overwrite the live state, so that a load has to bring every byte back."""
    with torch.no_grad():
        for t in ts:
            t.fill_(7)


def same(model, opt, ref) -> bool:
    """The live state (fetched again: an optimizer's load replaces its state tensors) equals ``ref`` bit for bit."""
    ts = tensors_of(model, opt)
    return len(ts) == len(ref) and all(torch.equal(a, b) for a, b in zip(ts, ref))


def sync_rounds(args, dev, model, opt, root):
    """Sync save and load, shardpoint and DCP alternating; times and bit-exactness."""
    ref = [t.clone() for t in tensors_of(model, opt)]
    state = {"model": model, "optimizer": opt}
    out = {k: [] for k in ("sp_save", "dcp_save", "sp_load", "dcp_load")}
    exact = {"sp": True, "dcp": True}
    for r in range(args.repeats):
        for system in (("sp", "dcp") if r % 2 == 0 else ("dcp", "sp")):
            path = os.path.join(root, f"sync_{system}_{r}")
            t0 = time.perf_counter()  # the queue as the previous round left it: not emptied for the call
            if system == "sp":
                sp.save(path, state)
            else:
                dcp.save(dcp_state(model, opt), checkpoint_id=path)
            _sync(dev)
            out[f"{system}_save"].append(time.perf_counter() - t0)
            scramble(tensors_of(model, opt))
            t0 = time.perf_counter()
            if system == "sp":
                sp.load(path, state)
            else:
                dcp.load(dcp_state(model, opt), checkpoint_id=path)
            _sync(dev)
            out[f"{system}_load"].append(time.perf_counter() - t0)
            exact[system] &= same(model, opt, ref)
            shutil.rmtree(path, ignore_errors=True)
    return {k: _median(v) for k, v in out.items()}, exact


class Mode:
    """One way of checkpointing in the loop: start a save, and wait for it."""

    def __init__(self, name: str, model, opt, dev):
        self.name, self.model, self.opt, self.dev = name, model, opt, dev
        self.saver = None
        self.pending = None
        self.stager = None
        self.planner = None
        self.note = ""
        self.flat = False  # DCP with the stager: the state flattened to tensors if it refused the nested one
        if name.startswith("sp"):
            self.saver = sp.AsyncSaver(prewarm_state={"model": model, "optimizer": opt})
        elif name == "dcp-stager":
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(True, True, True, True))
            self.planner = DefaultSavePlanner(enable_plan_caching=True)

    def dcp_state(self) -> dict:
        state = dcp_state(self.model, self.opt)
        if self.flat:
            return {f"t{i}": t for i, t in enumerate(tensors_of(self.model, self.opt))}
        return state

    def _dcp_start(self, path: str):
        if self.stager is None:
            return dcp.async_save(dcp_state(self.model, self.opt), checkpoint_id=path)
        try:
            return dcp.async_save(self.dcp_state(), checkpoint_id=path, async_stager=self.stager, planner=self.planner)
        except Exception as e:  # noqa: BLE001 - reported with the figures
            if self.flat:
                raise
            self.flat = True
            self.note = f"dcp-stager refused the nested state ({type(e).__name__}: {e}); its state was flattened to tensors"
            print(self.note, flush=True)
            return dcp.async_save(self.dcp_state(), checkpoint_id=path, async_stager=self.stager, planner=self.planner)

    def start(self, path: str, durable: list) -> None:
        t_call = time.perf_counter()
        if self.saver is not None:
            h = self.saver.save(path, {"model": self.model, "optimizer": self.opt}, mode=self.name.split("-")[1])
            self.pending = h
            threading.Thread(target=lambda: (h.wait(), durable.append(time.perf_counter() - t_call)), daemon=True).start()
        else:
            ret = self._dcp_start(path)
            # A Future, or (with an asynchronous stager) a response whose staging must end before the step.
            fut = getattr(ret, "upload_completion", ret)
            staging = getattr(ret, "staging_completion", None)
            if staging is not None:
                staging.result()
            self.pending = fut
            fut.add_done_callback(lambda _f: durable.append(time.perf_counter() - t_call))

    def wait(self) -> None:
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        if self.saver is not None:
            self.saver.wait()
        else:
            p.result()

    def load(self, path: str) -> None:
        if self.saver is not None:
            sp.load(path, {"model": self.model, "optimizer": self.opt})
        else:
            dcp.load(self.dcp_state(), checkpoint_id=path)

    def pinned(self) -> tuple[int, int | None]:
        """(bytes the saver holds now, the peak of its own registered memory) for shardpoint; (0, None) for DCP."""
        dev = self.saver.device if self.saver is not None else None
        if dev is None:
            return 0, None
        owned = getattr(dev, "owned", None)  # CUDA: the library's registered memory, outside PyTorch's statistics
        return dev.pinned_bytes, None if owned is None else owned.peak_held

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.stager is not None:
            self.stager.close()


def loop_mode(args, dev, model, opt, step, name: str, root: str) -> dict:
    _reset_pinned_peak()
    mode = Mode(name, model, opt, dev)
    windows, stalls, durable = [], [], []
    ck = 0
    half = args.window // 2
    for w in range(2 * args.checkpoints + 1):
        if w % 2 == 0:
            mode.wait()  # a baseline window is timed only once the previous checkpoint is durable
        _sync(dev)
        t0 = time.perf_counter()
        for i in range(args.window):
            if w % 2 == 1 and i == half:
                # Mid-window: the steps before it are still queued on the device, as in a real loop.
                t_call = time.perf_counter()
                mode.wait()  # the previous save, if still running, counts as stall
                mode.start(os.path.join(root, f"{name}_{ck}"), durable)
                stalls.append(time.perf_counter() - t_call)
                ck += 1
            step()
        _sync(dev)
        windows.append(time.perf_counter() - t0)
    mode.wait()
    time.sleep(0.05)  # the durable callbacks run on other threads
    lost = [windows[i] - (windows[i - 1] + windows[i + 1]) / 2 for i in range(1, len(windows) - 1, 2)]
    # The bit-exact check: one more checkpoint, a copy of the state taken at its call.
    _sync(dev)
    ref = [t.clone() for t in tensors_of(model, opt)]
    path = os.path.join(root, f"{name}_check")
    mode.start(path, [])
    for _ in range(3):
        step()
    mode.wait()
    after = [t.clone() for t in tensors_of(model, opt)]
    scramble(tensors_of(model, opt))
    mode.load(path)
    _sync(dev)
    exact = same(model, opt, ref)
    with torch.no_grad():  # training goes on from where it was
        for t, a in zip(tensors_of(model, opt), after):
            t.copy_(a)
    pinned, own_peak = mode.pinned()
    peak, held = _pinned_stats()
    mode.close()
    del ref, after
    for k in range(ck):
        shutil.rmtree(os.path.join(root, f"{name}_{k}"), ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "stall": _median(stalls[1:]), "stall_first": stalls[0], "lost": _median(lost[1:]), "lost_first": lost[0],
        "durable": _median(durable[1:]), "exact": exact, "pinned": pinned, "pinned_peak": peak, "pinned_held": held,
        "registered_peak": own_peak,
        "note": mode.note,
    }


def _roundtrip(model, opt, path: str, ref) -> bool:
    """Load ``path`` into the scrambled live state and compare with ``ref`` bit for bit; the state is put back after."""
    after = [t.clone() for t in tensors_of(model, opt)]
    scramble(tensors_of(model, opt))
    sp.load(path, {"model": model, "optimizer": opt})
    ok = same(model, opt, ref)
    with torch.no_grad():
        for t, a in zip(tensors_of(model, opt), after):
            t.copy_(a)
    return ok


def _small_state(devs, width: int = 1024):
    torch.manual_seed(1)
    layers = [nn.Linear(width, width).to(devs[i % len(devs)]) for i in range(2 * len(devs))]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [torch.randn(256, width, device=d) for d in devs]

    def step() -> None:
        loss = sum(layers[i](xs[i % len(devs)]).square().mean().to(devs[0]) for i in range(len(layers)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, opt, step


def _checked(name: str, out: dict, fn) -> None:
    try:
        out[name] = bool(fn())
    except Exception as e:  # noqa: BLE001 - a failed check is reported, not raised
        print(f"device check {name!r} failed: {type(e).__name__}: {e}", flush=True)
        out[name] = False


def device_checks(dev: torch.device, root: str) -> dict[str, bool]:
    """Bit-exact checks only a GPU can make: a side stream, several GPUs, a graph captured during a save."""
    if dev.type != "cuda":
        return {}
    out: dict[str, bool] = {}
    model, opt, step = _small_state([dev])
    state = {"model": model, "optimizer": opt}

    def side_stream() -> bool:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        path = os.path.join(root, "chk_side")
        with torch.cuda.stream(side):
            step()  # the newest values are still being written on this stream when the save is called
            ref = [t.clone() for t in tensors_of(model, opt)]
            sp.save(path, state)
            h = sp.AsyncSaver(device=dev)
            h.save(path + "_async", state).wait()
            h.close()
        torch.cuda.current_stream(dev).wait_stream(side)
        return _roundtrip(model, opt, path, ref) and _roundtrip(model, opt, path + "_async", ref)

    _checked("side stream", out, side_stream)
    if torch.cuda.device_count() > 1:
        devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]

        def several() -> bool:
            m2, o2, _ = _small_state(devs)
            ref = [t.clone() for t in tensors_of(m2, o2)]
            path = os.path.join(root, "chk_multi")
            saver = sp.AsyncSaver()
            saver.save(path, {"model": m2, "optimizer": o2}).wait()
            saver.close()
            return _roundtrip(m2, o2, path, ref)

        _checked(f"{len(devs)} GPUs in one process", out, several)
    static_in = torch.randn(256, 1024, device=dev)
    static_out = torch.empty(256, 1024, device=dev)
    warm = torch.cuda.Stream(dev)
    warm.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(warm), torch.no_grad():
        for _ in range(3):
            static_out.copy_(model(static_in))
    torch.cuda.current_stream(dev).wait_stream(warm)
    for mode in ("eager", "lazy"):

        def graph_during_save(mode=mode) -> bool:
            saver = sp.AsyncSaver(device=dev)
            ref = [t.clone() for t in tensors_of(model, opt)]
            path = os.path.join(root, f"chk_graph_{mode}")
            h = saver.save(path, state, mode=mode)
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(g, capture_error_mode="global"):  # while the save's threads run
                static_out.copy_(model(static_in))
            g.replay()
            step()
            h.wait()
            saver.close()
            return _roundtrip(model, opt, path, ref)

        _checked(f"graph captured during a {mode} save", out, graph_during_save)
    return out


def init_group() -> None:
    """A one-rank gloo group (no network): DCP's async_save wants a CPU backend, and both systems then coordinate alike.

    One process trains on one GPU here, so no collective carries GPU tensors and NCCL is not needed.
    """
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def fmt(x, unit="s", digits=3):
    if x is None:
        return "-"
    if unit == "GB":
        return f"{x / 1e9:.2f} GB"
    return f"{x:.{digits}f} {unit}".rstrip()


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(info, lim, sync, exact, loops, extra=None) -> str:
    extra = extra or {}
    nbytes = info["bytes"]
    d2h, h2d = lim
    lines = [
        f"bench_gpu: {info['device']}, torch {torch.__version__}, state {nbytes / 1e9:.2f} GB "
        f"({info['layers']} x Linear {info['width']}x{info['width']} + AdamW), step {info['step'] * 1000:.1f} ms, "
        f"files in {info['dir']}",
        f"copy limit: device to host {d2h:.3f} s ({nbytes / d2h / 1e9:.1f} GB/s), host to device {h2d:.3f} s "
        f"({nbytes / h2d / 1e9:.1f} GB/s), {'pinned' if info['pinned'] else 'into preallocated host memory'}",
        "",
        f"{'measure':34} {'shardpoint':>12} {'DCP':>12} {'sp / DCP':>9} {'sp / limit':>11}",
    ]

    def row(label, a, b, lim_s=None, unit="s"):
        lines.append(f"{label:34} {fmt(a, unit):>12} {fmt(b, unit):>12} {ratio(a, b):>9} {ratio(a, lim_s):>11}")

    def rate(label, a, b):
        ga = None if a is None else nbytes / a / 1e9
        gb = None if b is None else nbytes / b / 1e9
        lines.append(f"{label:34} {fmt(ga, 'GB/s', 2):>12} {fmt(gb, 'GB/s', 2):>12} {ratio(ga, gb):>9} {'':>11}")

    row("sync save", sync["sp_save"], sync["dcp_save"], d2h)
    rate("sync save throughput", sync["sp_save"], sync["dcp_save"])
    row("load", sync["sp_load"], sync["dcp_load"], h2d)
    rate("load throughput", sync["sp_load"], sync["dcp_load"])
    for dcp_mode in ("dcp-async", "dcp-stager"):
        d = loops.get(dcp_mode, {})
        lines.append(f"-- DCP column: {dcp_mode}")
        for m in ("sp-eager", "sp-lazy"):
            e = loops.get(m, {})
            row(f"{m[3:]}: stall in the call", e.get("stall"), d.get("stall"), d2h)
            row(f"{m[3:]}: training time lost per ckpt", e.get("lost"), d.get("lost"), d2h)
            row(f"{m[3:]}: time until durable", e.get("durable"), d.get("durable"), None)
            row(f"{m[3:]}: first ckpt stall (warm-up)", e.get("stall_first"), d.get("stall_first"), None)
            row(f"{m[3:]}: pinned peak (allocator)", e.get("pinned_peak"), d.get("pinned_peak"), None, "GB")
    pins = {m: loops[m]["pinned"] for m in loops if m.startswith("sp")}
    lines.append(f"{'pinned memory counted by the saver':34} " + ", ".join(f"{m[3:]} {fmt(v, 'GB')}" for m, v in pins.items()))
    own = {m: loops[m].get("registered_peak") for m in loops if m.startswith("sp")}
    lines.append(f"{'saver registered memory, peak':34} " + ", ".join(f"{m[3:]} {fmt(v, 'GB')}" for m, v in own.items()))
    held = {m: loops[m].get("pinned_held") for m in loops}
    lines.append(f"{'pinned held at mode end (allocator)':34} " + ", ".join(f"{m} {fmt(v, 'GB')}" for m, v in held.items()))
    ex = {f"sync {k}": v for k, v in exact.items()} | {m: loops[m]["exact"] for m in loops} | extra
    lines.append(f"{'bit-exact':34} " + ", ".join(f"{k} {'-' if v is None else 'yes' if v else 'NO'}" for k, v in ex.items()))
    lines.append("(dcp-async: dcp.async_save with its default thread executor; dcp-stager: DefaultStager with pinned and")
    lines.append(" shared memory, asynchronous staging, non-blocking copies, and cached plans; its stall includes its staging)")
    lines.extend(loops[m]["note"] for m in loops if loops[m].get("note"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="small sizes, for any machine (CPU included)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--window", type=int, default=None, help="steps per window of the loop")
    ap.add_argument("--checkpoints", type=int, default=4, help="measured checkpoints per mode (plus a warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--device", default=None, help="default: cuda if available, else the accelerator, else cpu")
    ap.add_argument("--dry-run", action="store_true", help="a tiny state on the CPU: checks the script's own logic in seconds")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.small, args.device = True, "cpu"
        args.layers, args.width, args.window = 2, 64, 4
        args.checkpoints, args.repeats, args.step_ms = 2, 1, 1.0
    args.layers = args.layers or (4 if args.small else 12)
    args.width = args.width or (512 if args.small else 4096)
    args.window = args.window or (10 if args.small else 40)
    if args.device:
        dev = torch.device(args.device)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
        dev = torch.accelerator.current_accelerator()
    else:
        dev = torch.device("cpu")
    init_group()
    root = tempfile.mkdtemp(prefix="bench_gpu_", dir=args.dir)
    t_start = time.perf_counter()
    try:
        model, opt = build(args, dev)
        step, per = calibrate(model, opt, dev, args)
        ts = tensors_of(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
        info = {"device": name, "bytes": nbytes, "layers": args.layers, "width": args.width, "step": per, "dir": args.dir,
                "pinned": dev.type != "cpu"}
        print(f"state {nbytes / 1e9:.2f} GB on {name}; step {per * 1000:.1f} ms", flush=True)
        d2h, h2d, _ = copy_limit(ts, dev)
        print(f"copy limit {d2h:.3f} s down, {h2d:.3f} s up", flush=True)
        sync, exact = sync_rounds(args, dev, model, opt, root)
        print(f"sync rounds done: {sync}", flush=True)
        loops = {}
        for m in ("sp-eager", "sp-lazy", "dcp-async", "dcp-stager"):
            try:
                loops[m] = loop_mode(args, dev, model, opt, step, m, root)
            except Exception as e:  # noqa: BLE001 - a DCP configuration this machine cannot run is reported
                if m.startswith("sp"):
                    raise
                loops[m] = {"exact": None, "note": f"{m} could not run here: {type(e).__name__}: {e}"}
            print(f"{m}: {loops[m]}", flush=True)
        extra = device_checks(dev, root)
        print()
        print(report(info, (d2h, h2d), sync, exact, loops, extra))
        print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
        ok = all(exact.values()) and all(v["exact"] is not False for v in loops.values()) and all(extra.values())
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
