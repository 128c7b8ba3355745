"""shardpoint demo: save under 4-rank FSDP2, resume under 2-rank tensor parallelism.

1. Four ranks train a small GPT with FSDP2 for N steps and ``sp.save`` it.
   The same run then trains M more steps with no checkpoint involved: the
   uninterrupted reference loss curve.
2. Two ranks build the model with tensor parallelism, from a different random
   seed and with a fresh, never-stepped AdamW, ``sp.load`` the checkpoint
   (which reshards FSDP2 row shards into TP column/row shards, optimizer
   moments included) and train the same M steps.
3. The two curves are printed side by side. They must match to float
   tolerance; the script exits non-zero if they do not.

Every rank is a real process on gloo over 127.0.0.1 (CPU only). Run it from
the repository root::

    python examples/demo.py            # or: make demo
    python examples/demo.py --steps 20 --more 10 --keep /tmp/ckpt
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, loss_of

# A little bigger than the test model (~234k parameters), still quick on a laptop CPU.
CFG = GPTConfig(vocab=256, dim=64, heads=4, layers=4, seq=32)
RTOL = 1e-4  # relative tolerance for "the resumed curve matches"


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic, learnable batch for ``step``, the same on every rank.

    Each row counts through the vocabulary from a random start with a random
    stride (1 to 4), so the next token follows from the previous two: the loss
    falls visibly within a few dozen steps, unlike on uniform noise.
    """
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CFG.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    data = (start + stride * torch.arange(CFG.seq + 1)) % CFG.vocab
    return data[:, :-1], data[:, 1:]


def train_step(model, opt, step: int) -> float:
    """One AdamW step on batch ``step``; returns the loss before the step."""
    loss = loss_of(model, *batch(step))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# ------------------------------------------------------------------ rank functions
# Run by shardpoint.testing.launch as fn(rank, world, **args) on every rank, after
# the gloo process group is up. They must return JSON-serialisable values.


def train_and_save(rank: int, world: int, ckpt: str, steps: int, more: int) -> dict:
    """FSDP2 on all ranks: train ``steps``, save, then train ``more`` (the reference)."""
    model, opt = build("fsdp2", CFG, seed=0)
    first = [train_step(model, opt, s) for s in range(steps)]
    res = sp.save(ckpt, {"model": model, "optimizer": opt, "extra": {"step": steps}})
    after = [train_step(model, opt, steps + i) for i in range(more)]
    return {
        "first": first,
        "after": after,
        "bytes_written": res.bytes_written,
        "save_s": res.timings.get("total", 0.0),
    }


def resume(rank: int, world: int, ckpt: str, steps: int, more: int) -> dict:
    """Tensor parallel on all ranks, different seed, fresh optimizer: load, then train ``more``."""
    model, opt = build("tp", CFG, seed=1234)
    state = {"model": model, "optimizer": opt, "extra": {}}
    with torch.no_grad():  # next-batch loss of the fresh weights, to show the load replaces them
        fresh = float(loss_of(model, *batch(steps)))
    report = sp.load(ckpt, state, return_result=True)
    start = state["extra"]["step"]
    with torch.no_grad():  # ... and of the loaded weights, before any step
        check = float(loss_of(model, *batch(start)))
    losses = [train_step(model, opt, start + i) for i in range(more)]
    return {
        "start": start,
        "fresh": fresh,
        "check": check,
        "losses": losses,
        "bytes_read": report.bytes_read,
        "load_s": report.timings.get("total", 0.0),
    }


# ------------------------------------------------------------------ driver


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _layout(m) -> str:
    lay = m.layout
    entries = ", ".join(f"{k}={v}" for k, v in lay.get("entries", {}).items() if v)
    placements = sorted({str(p) for p in lay.get("placements", {}).values()})
    return f"world_size={lay.get('world_size')}; {entries}; placements: {', '.join(placements)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="steps before the checkpoint (default 20)")
    ap.add_argument("--more", type=int, default=10, help="steps after it, on both sides (default 10)")
    ap.add_argument("--keep", metavar="DIR", help="save the checkpoint here instead of a temp dir")
    a = ap.parse_args()

    # The ranks import this file as ``examples.demo``: the launcher puts the working
    # directory on PYTHONPATH, so run from the repository root; we add the root too.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from shardpoint.testing import launch

    nparams = sum(p.numel() for p in build("single", CFG)[0].parameters())
    print(f"TinyGPT {CFG.layers} layers, dim {CFG.dim}, {CFG.heads} heads, vocab {CFG.vocab}, "
          f"seq {CFG.seq}: {nparams:,} parameters; AdamW")

    with tempfile.TemporaryDirectory(prefix="shardpoint-demo-") as tmp:
        ckpt = os.path.abspath(a.keep) if a.keep else os.path.join(tmp, "ckpt")
        t0 = time.monotonic()
        saved = launch(4, "examples.demo:train_and_save", {"ckpt": ckpt, "steps": a.steps, "more": a.more})
        t1 = time.monotonic()
        first = saved[0]["first"]
        print(f"\n[4 ranks, FSDP2]  trained steps 0-{a.steps - 1} (loss {first[0]:.4f} -> {first[-1]:.4f}), "
              f"saved to {ckpt}, trained {a.more} more  ({t1 - t0:.1f}s)")

        m = sp.read_manifest(ckpt)
        written = sum(r["bytes_written"] for r in saved)
        print(f"  checkpoint: {_size(m.total_bytes)} of tensor data in {len(m.tensors)} tensors, "
              f"{len(m.files)} data files ({_size(written)} written by 4 ranks)")
        print(f"  save time:  {max(r['save_s'] for r in saved) * 1000:.1f} ms (slowest rank)")
        print(f"  save-time layout in the manifest: {_layout(m)}")

        t2 = time.monotonic()
        resumed = launch(2, "examples.demo:resume", {"ckpt": ckpt, "steps": a.steps, "more": a.more})
        t3 = time.monotonic()
        r0 = resumed[0]
        print(f"\n[2 ranks, TP]     fresh model (seed 1234) loss at step {a.steps}: {r0['fresh']:.4f}; "
              f"after sp.load: {r0['check']:.4f}; trained {a.more} steps  ({t3 - t2:.1f}s)")
        print(f"  load time:  {max(r['load_s'] for r in resumed) * 1000:.1f} ms (slowest rank), "
              f"{_size(sum(r['bytes_read'] for r in resumed))} read by 2 ranks; resumed at step {r0['start']}")

    ref, got = saved[0]["after"], r0["losses"]
    print(f"\n{'step':>5} | {'4-rank FSDP2 (uninterrupted)':>28} | {'2-rank TP (resumed)':>19} | {'abs diff':>9}")
    print(f"{'-' * 5}-+-{'-' * 28}-+-{'-' * 19}-+-{'-' * 9}")
    worst = 0.0
    for i, (x, y) in enumerate(zip(ref, got)):
        d = abs(x - y)
        worst = max(worst, d / max(abs(x), 1e-12))
        print(f"{a.steps + i:>5} | {x:>28.6f} | {y:>19.6f} | {d:>9.2e}")
    ok = len(ref) == len(got) == a.more and r0["start"] == a.steps and worst <= RTOL
    verdict = "MATCHES" if ok else "DOES NOT MATCH"
    print(f"\nResumed curve {verdict} the uninterrupted one "
          f"(max relative diff {worst:.1e}, tolerance {RTOL:.0e}).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
