"""Asynchronous save while training: shardpoint vs PyTorch DCP vs ByteCheckpoint.

Every system trains the same 4-rank FSDP2 TinyGPT with AdamW (forward,
backward, optimizer step) in its own 4-rank job (gloo, one torch thread per
rank). The loop is cut into windows of ``--every`` steps; a checkpoint starts
every other window, so each checkpoint window has windows without a
checkpoint on both sides, in the same job, under the same machine load. Per
checkpoint it measures:

- stall: the time the training loop was blocked, i.e. the save call itself,
  plus a wait for the previous save before it (DCP's ``future.result()``,
  shardpoint's ``saver.wait()``), plus any wait before the next optimizer
  step (shardpoint lazy: ``handle.fence()``, which is what its step pre-hook
  does; DCP with asynchronous staging: ``staging_completion.result()``);
- durable: from the save call until the checkpoint is committed on storage;
- overhead: the wall time of the window that starts with the save call (the
  call, the ``--every`` steps after it and every wait they incur) over the
  mean of its two neighbouring windows without a checkpoint, minus one. That
  is the step-time overhead of checkpointing every ``--every`` steps, as long
  as a save finishes within its window (the durable column says whether);
- peak RSS of each rank (sampled every 10 ms; with and without child
  processes, which DCP's process executor and ByteCheckpoint's helpers use);
- correctness: every measured checkpoint is loaded into a freshly built model
  and optimizer, and the xxh3 fingerprints of all local shards are compared
  with the fingerprints taken right before the save call (bit-exact).

The first checkpoint of each run is a warm-up (worker start, plan caches,
buffer allocation) and is reported separately, not in the medians.

Usage::

    python bench/bench_async.py --quick
    python bench/bench_async.py --json bench-async.json --plot docs/bench_async.png
    python bench/bench_async.py --size 100mb --layout ddp --systems sp-lazy,dcp-thread   # suite

``--layout`` trains another 4-rank layout instead of FSDP2 (``ddp``; ``2d``:
FSDP2 x TP on a 2 x 2 mesh, where ByteCheckpoint 0.0.2 has no checkpointer and
is skipped); ``--size`` picks one of the suite's state sizes (``100mb``, ``1.5gb``);
``--world`` trains on another number of ranks.

For every shardpoint system it also prints the call's profile: per rank, the
median milliseconds of each phase of the save call (prepare, plan, stage,
copies, digests, guard, ...; see ``bench/async_profile.py``), so that a slower
stall shows where it grew, and the same for the checkpoint with the largest
stall, so that a spike shows where it lives. The per-rank profiles are in the
JSON under ``call_profile_per_rank`` and ``slowest_call_profile_per_rank`` (seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import async_profile as AP  # noqa: E402

SYSTEMS = {
    "none": "no checkpoints (baseline)",
    "sp-eager": "shardpoint AsyncSaver, eager snapshot, staging >= state",
    "sp-lazy": "shardpoint AsyncSaver, lazy snapshot, staging >= state",
    "sp-lazy-small": "shardpoint AsyncSaver, lazy snapshot, staging < state",
    "sp-eager-small": "shardpoint AsyncSaver, eager snapshot, staging < state",
    "dcp-thread": "DCP async_save, thread executor (default synchronous staging)",
    "dcp-process": "DCP async_save, process executor (default synchronous staging)",
    "dcp-thread-stager": "DCP async_save, thread executor, DefaultStager(StagingOptions(False, False, True, False))",
    "bcp": "ByteCheckpoint 0.0.2 save(framework='fsdp2', fast_saving=True)",
}
QUICK_SYSTEMS = ["sp-eager", "sp-lazy", "sp-lazy-small", "dcp-thread", "dcp-process", "bcp"]
DEFAULT_SYSTEMS = ["sp-eager", "sp-lazy", "sp-lazy-small", "dcp-thread", "dcp-process", "dcp-thread-stager", "bcp"]


# ====================================================================== rank side
def rank_job(rank: int, world: int, system: str, cfg: dict, root: str, every: int, n_ckpt: int,
             batch: int, staging_mb: int, small_mb: int, verify: bool, layout: str = "fsdp2") -> dict:
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.testing import GPTConfig, batch as make_batch, build, loss_of

    c = GPTConfig(**cfg)
    model, opt = build(layout, c, seed=0, lr=1e-4)
    bcp_framework = "ddp" if layout == "ddp" else "fsdp2"
    out: dict = {"rank": rank, "system": system}

    def step(i: int, before_step=None) -> None:
        x, y = make_batch(i, c, batch)
        loss = loss_of(model, x, y)
        loss.backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sampler = C.RssSampler().start()
    for i in range(2):  # warm-up: allocate optimizer state, settle the allocator
        step(10_000 + i)
    out["local_state_bytes"] = C.local_state_bytes(model, opt)

    saver = None
    stager = None
    bcp = None
    if system.startswith("sp-"):
        call_steps: list[dict] = []
        AP.install(call_steps)  # the call's phases per rank (see bench/async_profile.py)
        budget = (small_mb if system.endswith("-small") else staging_mb) << 20
        saver = sp.AsyncSaver(staging_bytes=budget, piece_bytes=min(64 << 20, budget // 4))
        out["staging_bytes"] = budget
    elif system.startswith("dcp-"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if system == "dcp-thread-stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(False, False, True, False))
        executor = AsyncCheckpointerType.PROCESS if system == "dcp-process" else AsyncCheckpointerType.THREAD
        # A thread-executor save runs DCP's collectives in a background thread; on the training
        # loop's own group they interleave with FSDP's collectives and gloo aborts ("Received data
        # size doesn't match expected size"). A dedicated gloo group is DCP's documented remedy.
        dcp_pg = dist.new_group(backend="gloo") if executor == AsyncCheckpointerType.THREAD else None
    elif system == "bcp":
        import bytecheckpoint as bcp

        C.bcp_loopback()

    mode = "lazy" if "lazy" in system else "eager"
    records: list[dict] = []  # one per checkpoint
    pending = {"handle": None, "fence": None}  # what must complete before the next optimizer step
    durable_at: dict[int, float] = {}
    handles: dict = {}
    lock = threading.Lock()

    def before_step():
        # Blocking before optimizer.step() that the checkpoint causes (attributed to the latest one).
        f = pending["fence"]
        if f is None:
            return
        t = time.monotonic()
        f()
        records[-1]["fence_s"] += time.monotonic() - t
        pending["fence"] = None

    def save(k: int, path: str) -> dict:
        rec = {"k": k, "wait_prev_s": 0.0, "call_s": 0.0, "fence_s": 0.0}
        t0 = time.monotonic()
        rec["t0"] = t0
        if saver is not None:
            saver.wait()  # normally instant: the previous save finished during the window
            t1 = time.monotonic()
            h = saver.save(path, {"model": model, "optimizer": opt}, mode=mode)
            pending["handle"] = handles[k] = h
            rec["steps"] = call_steps[-1] if call_steps else {}
            if mode == "lazy":
                pending["fence"] = h.fence
        elif system.startswith("dcp-"):
            prev = pending["handle"]
            if prev is not None:
                prev.result()
            t1 = time.monotonic()
            sd = C.dcp_state(model, opt)
            kw = {"async_stager": stager} if stager is not None else {}
            if dcp_pg is not None:
                kw["process_group"] = dcp_pg
            r = dcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=executor, **kw)
            fut = r.upload_completion if hasattr(r, "upload_completion") else r
            if hasattr(r, "staging_completion"):
                pending["fence"] = r.staging_completion.result

            def done(_f, k=k):
                with lock:
                    durable_at[k] = time.monotonic()

            fut.add_done_callback(done)
            pending["handle"] = fut
        elif system == "bcp":
            t1 = time.monotonic()

            def done(k=k):
                with lock:
                    durable_at[k] = time.monotonic()

            bcp.save(path, {"model": model, "optimizer": opt}, framework=bcp_framework, fast_saving=True,
                     global_steps=k, callback=done, ignore_append_global_steps_to_folder=True)
        else:
            t1 = time.monotonic()
        rec["wait_prev_s"] = t1 - t0
        rec["call_s"] = time.monotonic() - t1
        return rec

    out["rss_loop_start"] = sampler.rss()
    refs: dict[int, dict] = {}
    paths: dict[int, str] = {}
    windows: list[dict] = []  # {"b": boundary, "ckpt": a save started it, "s": seconds}
    step_times: list[float] = []
    # Boundaries b = 0, 1, 2, ... every `every` steps. A save starts each even window (b = 0 is
    # the warm-up save), odd windows run without one, so every checkpoint window has plain
    # windows on both sides in the same job: the overhead is measured against neighbours
    # that saw the same machine load.
    n_windows = 2 * n_ckpt + 2
    t_loop = time.monotonic()
    i = 0
    for b in range(n_windows):
        ckpt = system != "none" and b % 2 == 0
        k = b // 2
        if b == 0:
            out["mem_before_first_save"] = sampler.read()
        if ckpt:
            if verify and k > 0:
                refs[k] = C.local_hashes(model, opt)  # fingerprint of the state at the save call
            path = os.path.join(root, system, f"step_{i:06d}")
            paths[k] = path
        w0 = time.monotonic()
        if ckpt:
            records.append(save(k, path))
        for _ in range(every):
            i += 1
            ts = time.monotonic()
            step(i, before_step)
            step_times.append(time.monotonic() - ts)
        windows.append({"b": b, "ckpt": ckpt, "s": time.monotonic() - w0})
    out["loop_s"] = time.monotonic() - t_loop
    out["mem_loop"] = sampler.read()

    # Drain: wait for the last save to be durable.
    if saver is not None:
        saver.wait()
        out["ring_high_water"] = saver._ring.high_water if saver._ring is not None else 0
    elif system.startswith("dcp-") and pending["handle"] is not None:
        pending["handle"].result()
        if stager is not None:
            stager.close()
    elif system == "bcp":
        deadline = time.monotonic() + 300
        if rank == 0:
            while len(durable_at) < len(records) and time.monotonic() < deadline:
                time.sleep(0.01)
    dist.barrier()
    out["mem_all"] = sampler.stop()

    # Durable times.
    for rec in records:
        k = rec["k"]
        if saver is not None:
            # The handle's own timing: from the save call to the committed manifest.
            rec["durable_s"] = rec["wait_prev_s"] + handles[k].result.timings["total"]
            rec["sp_timings"] = {p: round(v, 4) for p, v in handles[k].result.timings.items()}
            rec["call_profile"] = AP.call_profile(rec.pop("steps", {}), handles[k].result.timings, rec["call_s"],
                                                  rec["wait_prev_s"], rec["fence_s"])
        elif k in durable_at:
            rec["durable_s"] = durable_at[k] - rec["t0"]
        else:
            rec["durable_s"] = None
        rec["stall_s"] = rec["wait_prev_s"] + rec["call_s"] + rec["fence_s"]
    out["records"] = records
    out["windows"] = windows
    out["step_times"] = step_times

    # Verify: load each measured checkpoint into a fresh model and optimizer; compare fingerprints.
    if verify and system != "none":
        m2, o2 = build(layout, c, seed=1234, lr=1e-4)
        checks = {}
        for k, ref in refs.items():
            path = paths[k]
            if saver is not None:
                sp.load(path, {"model": m2, "optimizer": o2})
            elif system.startswith("dcp-"):
                sd = C.dcp_state(m2, o2)
                dcp.load(sd, checkpoint_id=path)
                C.dcp_apply(m2, o2, sd)
            elif system == "bcp":
                bcp.load(path, {"model": m2, "optimizer": o2}, framework=bcp_framework, fast_loading=True)
            bad = C.diff_hashes(ref, C.local_hashes(m2, o2))
            checks[k] = {"ok": not bad, "differs": bad[:5], "n": len(ref)}
        out["verify"] = checks
    if rank == 0 and system != "none":
        out["ckpt_bytes"] = C.dir_bytes(paths[max(paths)])
    dist.barrier()
    return out

# ====================================================================== parent side
def _measured(recs: list[list[dict]], key: str) -> list[float]:
    """Per measured checkpoint (k >= 1): the worst rank's value of ``key``."""
    by_k: dict[int, list[float]] = {}
    for rank_recs in recs:
        for r in rank_recs:
            if r["k"] >= 1 and r.get(key) is not None:
                by_k.setdefault(r["k"], []).append(r[key])
    return [max(v) for _k, v in sorted(by_k.items())]


def _first(recs: list[list[dict]], key: str):
    vals = [r[key] for rank_recs in recs for r in rank_recs if r["k"] == 0 and r.get(key) is not None]
    return max(vals) if vals else None


def overhead_pairs(windows: list[dict]) -> list[float]:
    """Per measured checkpoint window: its time over the mean of its plain neighbours, minus one."""
    by_b = {w["b"]: w for w in windows}
    out = []
    for w in windows:
        if not w["ckpt"] or w["b"] == 0:
            continue
        nb = [by_b[x]["s"] for x in (w["b"] - 1, w["b"] + 1) if x in by_b and not by_b[x]["ckpt"] and x > 1]
        if nb:
            out.append(w["s"] / (sum(nb) / len(nb)) - 1)
    return out


def aggregate(system: str, ranks: list[dict], every: int) -> dict:
    recs = [r["records"] for r in ranks]
    wins = ranks[0]["windows"]
    ckpt_w = [w["s"] for w in wins if w["ckpt"] and w["b"] > 0]  # window 0 holds the warm-up save
    plain_w = [w["s"] for w in wins if not w["ckpt"] and w["b"] > 1]
    steps = ranks[0]["step_times"][2 * every:]
    pairs = overhead_pairs(wins)
    agg = {
        "system": system,
        "description": SYSTEMS[system],
        "stall_s": C.summary(_measured(recs, "stall_s")),
        "call_s": C.summary(_measured(recs, "call_s")),
        "wait_prev_s": C.summary(_measured(recs, "wait_prev_s")),
        "fence_s": C.summary(_measured(recs, "fence_s")),
        "durable_s": C.summary(_measured(recs, "durable_s")),
        "first_stall_s": _first(recs, "stall_s"),
        "first_durable_s": _first(recs, "durable_s"),
        "ckpt_window_s": C.summary(ckpt_w),
        "plain_window_s": C.summary(plain_w),
        "windows": wins,
        "overhead": C.summary(pairs),
        "overhead_of_medians": (C.summary(ckpt_w)["median"] / C.summary(plain_w)["median"] - 1) if ckpt_w and plain_w else None,
        "step_s": C.summary(steps),
        "peak_rss_before_first_save_mb": C.summary(r["mem_before_first_save"]["peak_rss"] / 2**20 for r in ranks),
        "peak_rss_mb": C.summary(r["mem_all"]["peak_rss"] / 2**20 for r in ranks),
        "peak_rss_with_children_mb": C.summary(r["mem_all"]["peak_rss_with_children"] / 2**20 for r in ranks),
        "peak_rss_over_loop_start_mb": C.summary((r["mem_all"]["peak_rss"] - r["rss_loop_start"]) / 2**20 for r in ranks),
        "peak_rss_per_rank_mb": [round(r["mem_all"]["peak_rss"] / 2**20, 1) for r in ranks],
        "peak_rss_with_children_per_rank_mb": [round(r["mem_all"]["peak_rss_with_children"] / 2**20, 1) for r in ranks],
        "ru_maxrss_per_rank_mb": [round(r["mem_all"]["ru_maxrss"] / 2**20, 1) for r in ranks],
        "state_bytes": sum(r["local_state_bytes"] for r in ranks),
        "ckpt_bytes": ranks[0].get("ckpt_bytes"),
    }
    if "staging_bytes" in ranks[0]:
        agg["staging_bytes_per_rank"] = ranks[0]["staging_bytes"]
        agg["ring_high_water_per_rank"] = [r.get("ring_high_water") for r in ranks]
    if "sp_timings" in (ranks[0]["records"][-1] if ranks[0]["records"] else {}):
        agg["sp_timings_rank0_last"] = ranks[0]["records"][-1]["sp_timings"]
        agg["sp_timings_last_per_rank"] = [r["records"][-1]["sp_timings"] if r["records"] else None for r in ranks]
        agg["call_profile_per_rank"] = [AP.median_profile([x["call_profile"] for x in r["records"] if x["k"] >= 1 and "call_profile" in x])
                                        for r in ranks]
        measured = [x["k"] for x in ranks[0]["records"] if x["k"] >= 1 and "call_profile" in x]
        if measured:
            def worst_stall(k):
                return max(x["stall_s"] for r in ranks for x in r["records"] if x["k"] == k)
            worst = max(measured, key=worst_stall)
            agg["slowest_checkpoint"] = worst
            agg["slowest_call_profile_per_rank"] = [next((x["call_profile"] for x in r["records"] if x["k"] == worst), {})
                                                    for r in ranks]
    if system != "none":
        checks = [v for r in ranks for v in (r.get("verify") or {}).values()]
        agg["verified"] = bool(checks) and all(v["ok"] for v in checks)
        agg["verified_checkpoints"] = len(ranks[0].get("verify") or {})
        agg["verify_failures"] = [v for v in checks if not v["ok"]][:3]
    return agg


def run_system(system: str, args, cfg: dict, root: str) -> dict:
    from shardpoint.testing import launch

    t = time.monotonic()
    la = C.load_average()
    ranks = launch(args.world, "bench_async:rank_job", {
        "system": system, "cfg": cfg, "root": root, "every": args.every, "n_ckpt": args.checkpoints,
        "batch": args.batch, "staging_mb": args.staging_mb, "small_mb": args.small_mb, "verify": not args.no_verify,
        "layout": args.layout,
    }, timeout=args.timeout)
    agg = aggregate(system, ranks, args.every)
    agg["job_s"] = round(time.monotonic() - t, 1)
    agg["load_average_before"] = la
    shutil.rmtree(os.path.join(root, system), ignore_errors=True)
    return agg


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["systems"] if r["system"] != "none" and "error" not in r]
    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))

    def bars(ax, key, title, scale=1.0, log=False, unit=""):
        med = [(r[key]["median"] or 0) * scale for r in rows]
        lo = [m - (r[key]["min"] or 0) * scale for m, r in zip(med, rows)]
        hi = [(r[key]["max"] or 0) * scale - m for m, r in zip(med, rows)]
        colors = ["tab:green" if n.startswith("sp-") else "tab:blue" if n.startswith("dcp") else "tab:orange" for n in names]
        ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_title(title)
        ax.set_ylabel(unit)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=60)

    bars(axes[0], "stall_s", "training stall per checkpoint", 1000, log=True, unit="ms (log)")
    bars(axes[1], "overhead", f"time of a {results['config']['every']}-step window with a checkpoint", 100, unit="% over the neighbouring windows without one")
    axes[1].axhline(5, color="red", ls="--", lw=1)
    bars(axes[2], "durable_s", "save call -> durable", 1, unit="s")
    bars(axes[3], "peak_rss_with_children_mb", "peak RSS per rank (+children)", 1, unit="MiB")
    axes[3].axhline(results["baseline_peak_rss_mb"], color="gray", ls="--", lw=1)
    fig.suptitle(f"{results['config']['world']}-rank {results['config'].get('layout', 'fsdp2').upper()} TinyGPT + AdamW, {results['state_mb']:.0f} MB state, CPU/gloo (2 cores), "
                 f"load avg {results['load_average_start'][0]:.2f} at start, {results['load_average_end'][0]:.2f} at end; "
                 "dashed: max rank's peak RSS in the two warm-up steps before any save")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer checkpoints and systems (< 3 min)")
    ap.add_argument("--systems", default=None, help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--size", default=None, help="a suite state size (100mb, 1.5gb): sets vocab, dim, heads, layers")
    ap.add_argument("--layout", default="fsdp2", choices=("fsdp2", "ddp", "2d"), help="4-rank layout that trains (default fsdp2)")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--world", type=int, default=4, help="ranks that train (default 4; the 2-d layout needs 4)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--checkpoints", type=int, default=None, help="measured checkpoints per system (plus one warm-up)")
    ap.add_argument("--staging-mb", type=int, default=1024, help="per-rank staging budget for sp-eager/sp-lazy")
    ap.add_argument("--small-mb", type=int, default=None, help="per-rank staging budget for the *-small runs (default 32, quick 8)")
    ap.add_argument("--root", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=1200, help="give up waiting for a quiet machine after this many seconds")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    for a in ("json", "plot", "root"):
        if getattr(args, a):
            setattr(args, a, os.path.abspath(getattr(args, a)))
    C.setup_env()

    q = args.quick
    sized = C.size_cfg(args.size) if args.size else {}
    args.dim = args.dim or sized.get("dim") or (384 if q else 768)
    args.layers = args.layers or sized.get("layers") or (4 if q else 3)
    args.batch = args.batch or 4
    args.seq = args.seq or 16
    args.checkpoints = args.checkpoints or 3
    args.small_mb = args.small_mb or (8 if q else 32)
    if q and args.every == 10:
        args.every = 5
    systems = args.systems.split(",") if args.systems else (QUICK_SYSTEMS if q else DEFAULT_SYSTEMS)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}")
    bcp_status = C.bytecheckpoint_status()
    if not bcp_status["available"]:
        print(f"# ByteCheckpoint unavailable, skipped: {bcp_status['reason']}")
        systems = [s for s in systems if s != "bcp"]
    if args.layout == "2d" and "bcp" in systems:
        print("# ByteCheckpoint 0.0.2 has no checkpointer for 2-D (FSDP2 x TP) models: skipped")
        systems = [s for s in systems if s != "bcp"]
    cfg = {"vocab": sized.get("vocab") or (1024 if q else 2048), "dim": args.dim, "heads": args.dim // 64, "layers": args.layers, "seq": args.seq}
    quiet = C.wait_quiet(args.wait_quiet, args.wait_max) if args.wait_quiet else {"load_average_at_start": C.load_average()}
    root = args.root or tempfile.mkdtemp(prefix="sp-bench-async-")
    os.makedirs(root, exist_ok=True)
    results = {
        "benchmark": "async_save",
        "command": "python bench/bench_async.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"model": cfg, "world": args.world, "layout": args.layout, "size": args.size, "optimizer": "AdamW", "every": args.every,
                   "checkpoints": args.checkpoints, "batch": args.batch, "staging_mb": args.staging_mb,
                   "small_mb": args.small_mb},
        "machine": C.machine_info(),
        "git": C.git_rev(),
        "bytecheckpoint": bcp_status,
        "load_average_start": quiet["load_average_at_start"],
        "systems": [],
    }
    print(f"# {args.world}-rank {args.layout.upper()} TinyGPT {cfg}, AdamW, checkpoint every {args.every} steps, "
          f"{args.checkpoints} measured checkpoints (+1 warm-up); load average {results['load_average_start'][0]:.2f}", flush=True)
    try:
        for s in systems:
            try:
                agg = run_system(s, args, cfg, root)
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                msg = str(e)
                print(f"# {s} FAILED: {msg[:2000]}")
                results["systems"].append({"system": s, "description": SYSTEMS[s], "error": C.failure(msg)})
                continue
            results["systems"].append(agg)
            print(f"{s:18s} stall {C.fmt(agg['stall_s'], 1000, 1)} ms  overhead {C.fmt(agg['overhead'], 100, 1)} %  "
                  f"durable {C.fmt(agg['durable_s'], 1, 2)} s  peak rss(+children) {C.fmt(agg['peak_rss_with_children_mb'], 1, 0)} MiB"
                  f"  verified={agg.get('verified', '-')}  ({agg['job_s']} s)", flush=True)
            if agg.get("call_profile_per_rank"):
                print(AP.profile_table(s, agg["call_profile_per_rank"]), flush=True)
                print(AP.profile_table(s, agg["slowest_call_profile_per_rank"],
                                       f"the slowest checkpoint, #{agg['slowest_checkpoint']}"), flush=True)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    ok = [r for r in results["systems"] if "error" not in r]
    if not ok:
        if args.json:
            C.write_json(args.json, results)
        return 1
    # Peak RSS without checkpoints: the "none" runs, else every run's peak before its first save.
    base_mem = [r["peak_rss_mb"]["max"] for r in ok if r["system"] == "none"] or \
        [r["peak_rss_before_first_save_mb"]["max"] for r in ok]
    results["baseline_peak_rss_mb"] = max(base_mem)
    results["state_mb"] = ok[0]["state_bytes"] / 1e6
    results["load_average_end"] = C.load_average()
    dcp = next((r for r in ok if r["system"] == "dcp-thread"), None)
    print(f"\n# state {results['state_mb']:.0f} MB over {args.world} ranks; load average at end {results['load_average_end'][0]:.2f}")
    print(f"{'system':18s} {'stall ms':>8s} {'vs dcp-thread':>13s} {'overhead':>9s} {'durable s':>9s} {'peak MiB':>9s} {'+children':>9s}  ok")
    for r in ok:
        if r["system"] == "none":
            continue
        if dcp and r["stall_s"]["median"]:
            r["stall_vs_dcp_thread"] = r["stall_s"]["median"] / dcp["stall_s"]["median"]
        ratio = r.get("stall_vs_dcp_thread")
        print(f"{r['system']:18s} {r['stall_s']['median'] * 1000:8.1f} {('1/%.1f' % (1 / ratio)) if ratio else '-':>13s} "
              f"{100 * r['overhead']['median']:8.1f}% {r['durable_s']['median'] or float('nan'):9.2f} "
              f"{r['peak_rss_mb']['max']:9.0f} {r['peak_rss_with_children_mb']['max']:9.0f}  {r.get('verified')}")
    goals = {}
    for name in ("sp-eager", "sp-lazy"):
        r = next((x for x in ok if x["system"] == name), None)
        if r and dcp:
            goals[name] = {
                "stall_le_dcp_over_10": r["stall_s"]["median"] <= dcp["stall_s"]["median"] / 10,
                "overhead_lt_5pct": r["overhead"]["median"] < 0.05,
            }
    results["goals"] = goals
    print(f"# goals (stall <= DCP thread / 10, overhead < 5%): {goals}")
    if args.json:
        C.write_json(args.json, results)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"# wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
