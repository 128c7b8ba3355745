"""The kill-and-restart story, end to end, in about a minute on a laptop CPU.

1. Train a small GPT with FSDP2 on 4 ranks under torchrun (``--max-restarts=3``).
2. SIGKILL rank 2 after step 14.
3. torchrun restarts the group; ``CheckpointManager.restore`` resumes from the
   newest complete checkpoint (step 10) and replays steps 11-14 bit-exactly.
4. Relaunch on 2 ranks with tensor parallelism; the restore reshards.
5. Print the loss curve across all of it as a table, and save a PNG plot.

Run::

    python examples/elastic_demo.py --out demo_out/elastic

Needs ``matplotlib`` for the plot (in the ``test`` extra); without it the
table is still printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "train_elastic.py")


def torchrun(nproc: int, layout: str, steps: int, root: str, log: str, env: dict | None = None, restarts: int = 3) -> float:
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, e.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}", SCRIPT, "--root", root, "--steps", str(steps), "--layout", layout,
        "--interval", "5", "--keep-last", "3", "--loss-log", log,
    ]
    print(f"\n$ {' '.join(f'{k}={v}' for k, v in (env or {}).items())} torchrun --standalone "
          f"--nproc_per_node={nproc} --max-restarts={restarts} examples/train_elastic.py --layout {layout} --steps {steps}",
          flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=e, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("[attempt") or line.startswith("stopping"):
            print("   ", line)
    for line in p.stderr.splitlines():
        if "failed (exitcode" in line:
            print("    torchrun:", line.split("] ", 1)[-1][:120])
    if p.returncode != 0:
        sys.exit(f"torchrun failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return time.monotonic() - t0


def table(rows: list[dict]) -> list[str]:
    first_loss: dict[int, float] = {}
    out = [f"{'step':>4}  {'loss':>10}  {'ranks':>5}  {'layout':<6}  {'attempt':>7}  note", "-" * 72]
    prev = None
    for r in rows:
        note = []
        if prev is None:
            note.append("start")
        elif r["world"] != prev["world"] or r["layout"] != prev["layout"]:
            note.append(f"relaunch on {r['world']} ranks ({r['layout']}): resumed after step {r['step'] - 1}")
        elif r["attempt"] != prev["attempt"]:
            note.append(f"torchrun restart: resumed after step {r['step'] - 1}")
        if r["step"] in first_loss:
            same = r["loss"] == first_loss[r["step"]]
            note.append("replayed, loss identical" if same else f"replayed, loss differs ({first_loss[r['step']]:.6f})")
        else:
            first_loss[r["step"]] = r["loss"]
        out.append(f"{r['step']:>4}  {r['loss']:>10.6f}  {r['world']:>5}  {r['layout']:<6}  {r['attempt']:>7}  {'; '.join(note)}")
        prev = r
    return out


def plot(rows: list[dict], kill_step: int, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return False
    segments: list[list[dict]] = []
    for r in rows:
        if not segments or (r["world"], r["layout"], r["attempt"]) != (segments[-1][-1]["world"], segments[-1][-1]["layout"], segments[-1][-1]["attempt"]):
            segments.append([])
        segments[-1].append(r)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    styles = ["-o", "--s", "-^", ":d"]
    for i, seg in enumerate(segments):
        label = f"{seg[0]['world']} ranks, {seg[0]['layout']}, attempt {seg[0]['attempt']} (steps {seg[0]['step']}-{seg[-1]['step']})"
        ax.plot([r["step"] for r in seg], [r["loss"] for r in seg], styles[i % len(styles)], ms=4, label=label)
    for prev, seg in zip(segments, segments[1:]):
        if seg[0]["world"] == prev[0]["world"]:  # a torchrun restart: it resumed from a checkpoint
            ax.annotate(f"restart resumed\nafter step {seg[0]['step'] - 1}", (seg[0]["step"], seg[0]["loss"]),
                        fontsize=8, color="C1", xytext=(-10, -34), textcoords="offset points",
                        arrowprops={"arrowstyle": "->", "color": "C1"})
    ax.axvline(kill_step, color="red", lw=1, ls=":")
    ax.annotate(f"rank 2 SIGKILLed\nafter step {kill_step}", (kill_step, ax.get_ylim()[1]), color="red",
                ha="right", va="top", fontsize=8, xytext=(-4, -4), textcoords="offset points")
    if len(segments) > 2:
        relaunch = segments[-1][0]["step"] - 0.5
        ax.axvline(relaunch, color="gray", lw=1, ls="--")
        ax.annotate(f"relaunch on {segments[-1][0]['world']} ranks\n({segments[-1][0]['layout']})", (relaunch, ax.get_ylim()[1]),
                    color="gray", ha="left", va="top", fontsize=8, xytext=(4, -4), textcoords="offset points")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("shardpoint: SIGKILL, automatic torchrun restart, relaunch under another layout")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("demo_out", "elastic"), help="folder for checkpoints, log and plot")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=14)
    ap.add_argument("--steps", type=int, default=24, help="steps of the first run")
    ap.add_argument("--more", type=int, default=12, help="steps added by the relaunch")
    args = ap.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    root, log = os.path.join(args.out, "ckpt"), os.path.join(args.out, "loss.jsonl")
    t0 = time.monotonic()
    print(f"1-3. {args.ranks} ranks, FSDP2; rank 2 is SIGKILLed after step {args.kill_at}; torchrun restarts the group")
    torchrun(args.ranks, "fsdp2", args.steps, root, log, env={"KILL_AT_STEP": str(args.kill_at), "KILL_RANK": "2"})
    print(f"\n4. relaunch on {args.ranks // 2} ranks with tensor parallelism (the restore reshards)")
    torchrun(args.ranks // 2, "tp", args.steps + args.more, root, log, restarts=0)

    with open(log) as f:
        rows = [json.loads(line) for line in f]
    print("\n5. loss across the whole story\n")
    print("\n".join(table(rows)))
    png = os.path.join(args.out, "loss.png")
    if plot(rows, args.kill_at, png):
        print(f"\nplot: {png}")
    print(f"checkpoints kept: {sorted(n for n in os.listdir(root) if n.startswith('step_'))}")
    print(f"total {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
