"""Incremental checkpoints: a frozen base with small trainable adapters, saved by the manager ten times.

The state is a frozen base (``--size`` of float32 weights, default 200 MB)
plus LoRA-style adapters holding ``--trainable`` of its parameters (default
0.5%), with an AdamW whose state exists only for the adapters. Each step
changes the adapters and their optimizer state; the base never changes.

Two runs of ``--saves`` manager saves (blocking, ``keep_last=3``) are
measured: ``incremental=True`` and a full save each time. Printed:

- bytes written per incremental save after the first, against the adapter
  and optimizer bytes (the goal is at most 1.2x of them plus the manifest);
- time per save, incremental against full;
- load time of the last incremental checkpoint against a self-contained
  (consolidated) copy of it (the goal is at most 1.1x), both loads checked
  bit for bit.

    .venv/bin/python bench/bench_incremental.py                 # 200 MB base
    .venv/bin/python bench/bench_incremental.py --size 1gb --json out.json
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import shardpoint as sp  # noqa: E402


def parse_size(text: str) -> int:
    """``"200mb"`` or ``"1gb"`` as bytes."""
    t = text.lower().strip()
    for unit, mul in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mul)
    return int(t)


class Tuned(torch.nn.Module):
    """A frozen base of ``layers`` square weights, each with a trainable low-rank adapter pair."""

    def __init__(self, base_bytes: int, trainable: float, layers: int = 8):
        super().__init__()
        dim = int((base_bytes / 4 / layers) ** 0.5)
        rank = max(1, round(trainable * dim / 2))  # 2 * dim * rank adapter parameters per dim * dim weight
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(dim, dim, generator=g), requires_grad=False) for _ in range(layers)
        )
        self.down = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rank, dim, generator=g) * 0.01) for _ in range(layers))
        self.up = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(dim, rank, generator=g) * 0.01) for _ in range(layers))

    def step(self, opt: torch.optim.Optimizer) -> None:
        """One optimizer step on the adapters (a stand-in loss: no forward through the base)."""
        loss = sum((u @ d).square().mean() + d.sum() * 1e-3 for u, d in zip(self.up, self.down))
        opt.zero_grad()
        loss.backward()
        opt.step()


def data_bytes(folder: str) -> int:
    """Bytes of a checkpoint folder's own files."""
    return sum(os.path.getsize(os.path.join(p, n)) for p, _, ns in os.walk(folder) for n in ns)


def run(root: str, args, incremental: bool) -> dict:
    model = Tuned(args.size, args.trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = {"model": model, "optimizer": opt}
    mode = None if args.mode == "none" else args.mode
    mgr = sp.CheckpointManager(root, interval=1, keep_last=3, mode=mode, incremental=incremental, prewarm=False)
    times, blocked, written = [], [], []
    try:
        for step in range(1, args.saves + 1):
            model.step(opt)
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocked.append(time.perf_counter() - t0)  # the training loop's stall (a background save goes on)
            mgr.wait()
            times.append(time.perf_counter() - t0)
            written.append(data_bytes(os.path.join(root, f"step_{step:08d}")))
    finally:
        mgr.close()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return {"times": times, "blocked": blocked, "written": written, "trainable": trainable, "optimizer": opt_bytes,
            "want": {k: v.clone() for k, v in model.state_dict().items()}}


def timed_load(path: str, args, want: dict) -> float:
    """Seconds of one load of ``path`` into a fresh model and optimizer, checked bit for bit."""
    model = Tuned(args.size, args.trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    t0 = time.perf_counter()
    sp.load(path, {"model": model, "optimizer": opt})
    dt = time.perf_counter() - t0
    got = model.state_dict()
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    if bad:
        raise SystemExit(f"load of {path} differs in {bad[:5]}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("200mb"), help="frozen base size (200mb, 1gb)")
    ap.add_argument("--trainable", type=float, default=0.005, help="trainable fraction of the base's parameters")
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="loads timed per checkpoint (median)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--mode", choices=["none", "eager", "lazy"], default="none",
                    help="the manager's save mode: blocking saves (none) or background ones")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sp-incr-", dir=args.dir)
    try:
        inc = run(os.path.join(work, "incremental"), args, True)
        full = run(os.path.join(work, "full"), args, False)
        last = os.path.join(work, "incremental", f"step_{args.saves:08d}")
        copy = os.path.join(work, "consolidated")
        sp.consolidate(last, copy)
        loads_inc, loads_copy = [], []
        for _ in range(args.repeats):  # alternate, so neither always reads a warmer cache
            loads_inc.append(timed_load(last, args, inc["want"]))
            loads_copy.append(timed_load(copy, args, inc["want"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    later = inc["written"][1:]
    payload = inc["trainable"] + inc["optimizer"]
    out = {
        "base_bytes": args.size, "trainable_bytes": inc["trainable"], "optimizer_bytes": inc["optimizer"],
        "first_save_bytes": inc["written"][0], "later_save_bytes_median": statistics.median(later),
        "written_over_payload": statistics.median(later) / payload,
        "save_s_incremental_median": statistics.median(inc["times"][1:]),
        "save_s_full_median": statistics.median(full["times"][1:]),
        "mode": args.mode, "blocked_s_incremental_median": statistics.median(inc["blocked"][1:]),
        "load_s_incremental": statistics.median(loads_inc), "load_s_consolidated": statistics.median(loads_copy),
    }
    out["save_time_ratio"] = out["save_s_incremental_median"] / out["save_s_full_median"]
    out["load_time_ratio"] = out["load_s_incremental"] / out["load_s_consolidated"]
    mb = 1 << 20
    print(f"base {args.size / mb:.0f} MB, adapters {inc['trainable'] / mb:.2f} MB, AdamW state {inc['optimizer'] / mb:.2f} MB")
    print(f"bytes written per save after the first: {out['later_save_bytes_median'] / mb:.2f} MB "
          f"= {out['written_over_payload']:.3f}x adapters + optimizer (first save {inc['written'][0] / mb:.0f} MB)")
    print(f"time per save: incremental {out['save_s_incremental_median']:.3f} s, full {out['save_s_full_median']:.3f} s "
          f"(ratio {out['save_time_ratio']:.3f})")
    print(f"load of save {args.saves}: {out['load_s_incremental']:.3f} s, consolidated copy {out['load_s_consolidated']:.3f} s "
          f"(ratio {out['load_time_ratio']:.3f})")
    print(f"the loop's stall per incremental save ({args.mode}): {out['blocked_s_incremental_median']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
