"""Training time lost per checkpoint: every save mode against DCP, on one 2-rank FSDP2 + AdamW loop.

Both ranks train the same FSDP2 TinyGPT with AdamW (gloo, one torch thread
per rank) in one job. Each run of a mode times three windows of
``--window`` steps back to back: no checkpoint, a checkpoint every
``--every`` steps, no checkpoint. The windows without checkpoints are the
baseline of the one between them, so a machine whose load drifts (other
jobs) shifts both alike. The job repeats every mode ``--repeats`` times in a
balanced order (each mode runs after each other mode equally often). Modes:

- ``sp-eager`` / ``sp-lazy``: ``sp.AsyncSaver`` (what ``sp.async_save``
  uses), pre-warmed on construction with ``prewarm_state``;
- ``sp-peer``: ``CheckpointManager(memory=sp.PeerMemory(replicas=1,
  interval=1))``, a memory checkpoint replicated to the other rank's "host";
- ``dcp-async``: ``torch.distributed.checkpoint.async_save`` (thread
  executor, on its own gloo group, as DCP documents);
- ``dcp-sync``: ``torch.distributed.checkpoint.save``.

Per run (slowest rank) it measures:

- lost per checkpoint: (checkpoint window - mean of the two windows around
  it) / checkpoints in it: the training time a checkpoint costs, whatever
  the cause (the call, a wait in the step pre-hook, background work
  competing for the CPU). The checkpoint window ends when its last
  checkpoint is complete. Making savers and managers is not in it
  (``setup``, reported apart);
- stall: the time the training thread spent inside the checkpoint call
  (with DCP async: plus ``future.result()`` of the previous save; with sp
  lazy: plus the fence before ``optimizer.step``), per checkpoint;
  ``first stall`` is the first checkpoint of a run alone.

Reports medians over the runs, and ratios to ``dcp-async``.

Usage::

    python bench/bench_overhead.py                      # 680 MB state, a checkpoint every step
    python bench/bench_overhead.py --size 100mb --window 6 --json overhead.json
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from report import carryover_order  # noqa: E402

MODES = ("sp-eager", "sp-lazy", "sp-peer", "dcp-async", "dcp-sync")
SIZES = {"680mb": dict(vocab=4096, dim=768, heads=12, layers=7, seq=16), **C.SIZES,
         "tiny": dict(vocab=96, dim=32, heads=4, layers=2, seq=16)}


def _later_delete(paths: list[str]) -> None:
    """Delete older checkpoints off the training thread (rank 0), so disk use stays bounded."""
    threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths], daemon=True).start()


def run_mode(mode: str, rep: int, model, opt, c, root: str, shm: str, window: int, every: int, batch: int, dcp_pg) -> dict:
    """Three timed windows of ``window`` steps on this rank: none, checkpoints, none; returns their times."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardpoint as sp
    from shardpoint.testing import batch as make_batch, loss_of

    state = {"model": model, "optimizer": opt}
    run_root = os.path.join(root, f"{mode}-{rep}")
    saver = mgr = None
    dist.barrier()
    t = time.monotonic()
    if mode in ("sp-eager", "sp-lazy"):
        saver = sp.AsyncSaver(prewarm_state=state)
    elif mode == "sp-peer":
        mem = sp.PeerMemory(dir=os.path.join(shm, f"{rep}", os.environ["SHARDPOINT_HOST"]), replicas=1, interval=1)
        mgr = sp.CheckpointManager(run_root, interval=None, memory=mem, mode=None, prewarm_state=state)
    setup = time.monotonic() - t
    pending: dict = {"handle": None, "future": None}
    stalls: list[float] = []
    saved: list[str] = []

    def fence() -> None:
        h = pending["handle"]
        if h is not None and mode == "sp-lazy":
            t0 = time.monotonic()
            h.fence()
            stalls[-1] += time.monotonic() - t0
            pending["handle"] = None

    def checkpoint(step: int) -> None:
        path = os.path.join(run_root, f"step{step}")
        t0 = time.monotonic()
        if saver is not None:
            pending["handle"] = saver.save(path, state, mode="lazy" if mode == "sp-lazy" else "eager")
        elif mgr is not None:
            mgr.maybe_save(step, state)
        elif mode == "dcp-async":
            if pending["future"] is not None:
                pending["future"].result()
            pending["future"] = dcp.async_save(C.dcp_state(model, opt), checkpoint_id=path, process_group=dcp_pg)
        elif mode == "dcp-sync":
            dcp.save(C.dcp_state(model, opt), checkpoint_id=path)
        stalls.append(time.monotonic() - t0)
        if mode != "sp-peer":
            saved.append(path)
            if len(saved) > 2 and dist.get_rank() == 0:  # the one before the previous is complete
                _later_delete([saved[-3]])

    def timed(first: int, save: bool) -> float:
        dist.barrier()
        t0 = time.monotonic()
        for i in range(first, first + window):
            x, y = make_batch(i, c, batch)
            loss_of(model, x, y).backward()
            fence()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if save and (i - first + 1) % every == 0:
                checkpoint(i)
        if save:  # the last checkpoint's background work belongs to this window
            if saver is not None:
                saver.wait()
            if mgr is not None:
                mgr.wait()
            if pending["future"] is not None:
                pending["future"].result()
        dist.barrier()
        return time.monotonic() - t0

    base = 100_000 * (rep + 1)
    before = timed(base, False)
    during = timed(base + window, True)
    after = timed(base + 2 * window, False)
    if saver is not None:
        saver.close()
    if mgr is not None:
        mgr.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(run_root, ignore_errors=True)
        shutil.rmtree(os.path.join(shm, f"{rep}"), ignore_errors=True)
    return {"mode": mode, "rep": rep, "before_s": before, "during_s": during, "after_s": after, "setup_s": setup, "stalls": stalls}


def job(rank: int, world: int, root: str, shm: str, cfg: dict, window: int, every: int, batch: int, repeats: int, modes: list) -> dict:
    import torch.distributed as dist

    from shardpoint.testing import GPTConfig, build, train_step

    os.environ["SHARDPOINT_HOST"] = f"h{rank}"  # each rank plays one host: peer memory replicates to the other
    c = GPTConfig(**cfg)
    model, opt = build("fsdp2", c, seed=0, lr=1e-4)
    for i in range(2):  # allocate the optimizer state, settle the allocator
        train_step(model, opt, 10_000 + i, c)
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives must not share the training group
    runs = []
    for rep in range(repeats):
        for k in carryover_order(len(modes), rep):
            runs.append(run_mode(modes[k], rep, model, opt, c, root, shm, window, every, batch, dcp_pg))
    return {"rank": rank, "local_state_bytes": C.local_state_bytes(model, opt), "runs": runs}


def aggregate(ranks: list[dict], modes: list, window: int, every: int) -> dict:
    """Medians over runs of the slowest rank's windows: step time, lost time per checkpoint and stalls."""
    n_ckpt = window // every
    by: dict = {}
    for runs in zip(*(r["runs"] for r in ranks)):
        key = (runs[0]["mode"], runs[0]["rep"])
        w = {k: max(r[k] for r in runs) for k in ("before_s", "during_s", "after_s", "setup_s")}
        w["stalls"] = [max(s) for s in zip(*(r["stalls"] for r in runs))]
        by[key] = w
    out: dict = {"none": {"step_s": statistics.median((w["before_s"] + w["after_s"]) / 2 / window for w in by.values())}}
    for mode in modes:
        rows = [w for (m, _), w in sorted(by.items()) if m == mode]
        base = [(w["before_s"] + w["after_s"]) / 2 for w in rows]
        lost = [(w["during_s"] - b) / n_ckpt for w, b in zip(rows, base)]
        later = [s for w in rows for s in w["stalls"][1:]]
        out[mode] = {
            "step_s": statistics.median(w["during_s"] / window for w in rows),
            "base_step_s": statistics.median(b / window for b in base),
            "overhead": statistics.median(w["during_s"] / b - 1 for w, b in zip(rows, base)),
            "lost_per_ckpt_s": statistics.median(lost),
            "lost_values": lost,
            "stall_s": statistics.median(s for w in rows for s in w["stalls"]),
            "first_stall_s": statistics.median(w["stalls"][0] for w in rows),
            "later_stall_s": statistics.median(later) if later else None,
            "setup_s": statistics.median(w["setup_s"] for w in rows),
        }
    ref = out.get("dcp-async")
    for m, v in out.items():
        if m == "none":
            continue
        v["lost_vs_dcp_async"] = v["lost_per_ckpt_s"] / ref["lost_per_ckpt_s"] if ref and ref["lost_per_ckpt_s"] > 0 else None
        v["stall_vs_dcp_async"] = v["stall_s"] / ref["stall_s"] if ref and ref["stall_s"] > 0 else None
    return out


def table(res: dict) -> str:
    def r(x):
        return "" if x is None else f"{x:.2f}x"

    def s(x):
        return "" if x is None else f"{x:.3f}"

    lines = ["| mode | step s | overhead | lost per checkpoint s | vs DCP async | stall s | vs DCP async | first stall s | later stalls s | setup s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, v in res.items():
        if m == "none":
            lines.append(f"| none | {v['step_s']:.3f} | | | | | | | | |")
            continue
        lines.append(f"| {m} | {v['step_s']:.3f} | {v['overhead']:+.1%} | {v['lost_per_ckpt_s']:.3f} | {r(v['lost_vs_dcp_async'])} | "
                     f"{v['stall_s']:.3f} | {r(v['stall_vs_dcp_async'])} | {v['first_stall_s']:.3f} | {s(v['later_stall_s'])} | {v['setup_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="680mb", choices=sorted(SIZES), help="state size (TinyGPT + AdamW)")
    ap.add_argument("--window", type=int, default=4, help="steps per timed window")
    ap.add_argument("--every", type=int, default=1, help="a checkpoint every N steps in the checkpoint window")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--root", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m and m != "none"]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    C.setup_env()
    from shardpoint.testing import launch

    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=a.root) as disk, tempfile.TemporaryDirectory(dir=shm_base) as shm:
        ranks = launch(2, "bench_overhead:job", {"root": disk, "shm": shm, "cfg": SIZES[a.size], "window": a.window, "every": a.every,
                                                 "batch": a.batch, "repeats": a.repeats, "modes": modes}, timeout=a.timeout)
    res = aggregate(ranks, modes, a.window, a.every)
    state_mb = sum(r["local_state_bytes"] for r in ranks) / 1e6
    print(f"{a.size}: {state_mb:.0f} MB of state on 2 ranks, windows of {a.window} steps, a checkpoint every {a.every} step(s), "
          f"medians of {a.repeats} repeats (load average {C.load_average()[0]:.1f})")
    print(table(res))
    if a.json:
        C.write_json(a.json, {"size": a.size, "state_mb": state_mb, "window": a.window, "every": a.every, "repeats": a.repeats,
                              "results": res, "ranks": ranks, "commit": C.git_rev(), "machine": C.machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
