"""Automatic restart and elastic relaunch under torchrun, with real data loading and dropout.

``examples/train_elastic.py`` reads a map-style dataset through
``sp.ResumableSampler``/``sp.ResumableLoader``, applies dropout from each rank's
torch generator, and checkpoints model, optimizer, loader and ``sp.RNGState()``.

* Same layout: a run whose rank is SIGKILLed mid-way, restarted by the elastic
  agent and resumed by CheckpointManager, ends bit-identical to an
  uninterrupted run, with the same losses (replayed steps included, which
  needs the restored dropout streams) and the same samples at every step.
* Another number of ranks: a 4-rank run that dies is relaunched on 2 ranks;
  it resumes from the newest complete checkpoint, and over the whole epoch
  every sample is trained on exactly once.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.manager import CheckpointManager, OnDemand, step_folder

pytestmark = pytest.mark.dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "train_elastic.py")
GLOBAL_BATCH = 8


def torchrun(root, log, samples, *, steps, nproc=2, restarts=0, env=None, layout="fsdp2", n_samples=256,
             expect_ok=True):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, e.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}", SCRIPT, "--root", root, "--steps", str(steps), "--interval", "4",
        "--layout", layout, "--loss-log", log, "--samples-log", samples, "--samples", str(n_samples),
        "--global-batch", str(GLOBAL_BATCH),
    ]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600, check=False)
    detail = f"torchrun returned {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert (p.returncode == 0) == expect_ok, detail
    return p.stdout, read_jsonl(log)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def sample_records(folder):
    """Every per-rank record of consumed sample ids, in the order each rank wrote them."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "rank*.jsonl"))):
        out += read_jsonl(path)
    return out


def ids_per_step(records, keep=lambda r: True):
    """``{step: sorted ids of the global batch}`` over the records ``keep`` selects."""
    steps: dict[int, list[int]] = {}
    for r in records:
        if keep(r):
            steps.setdefault(r["step"], []).extend(r["ids"])
    return {s: sorted(v) for s, v in steps.items()}


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_bit_exact(tmp_path):
    steps = 12
    ref_root, run_root = str(tmp_path / "uninterrupted"), str(tmp_path / "interrupted")
    _, ref_log = torchrun(ref_root, str(tmp_path / "ref.jsonl"), str(tmp_path / "ref_samples"), steps=steps)
    out, log = torchrun(run_root, str(tmp_path / "run.jsonl"), str(tmp_path / "run_samples"), steps=steps,
                        restarts=2, env={"KILL_AT_STEP": "7", "KILL_RANK": "1"})

    # The first attempt died after step 7; the agent restarted it, and it resumed from a checkpoint.
    first = [r["step"] for r in log if r["attempt"] == 0]
    second = [r["step"] for r in log if r["attempt"] == 1]
    assert first == list(range(1, 8)), first
    assert second == list(range(5, steps + 1)), f"expected a resume after step 4, got {second}\n{out}"
    assert "killed by SIGKILL" in out and "resumed after step 4 (data epoch 0 position 32)" in out, out

    # Every loss, replayed steps 5-7 included, equals the uninterrupted run's, bit for bit. Dropout
    # draws from each rank's torch generator, so the replayed steps match only because the
    # generators came back from the checkpoint (a fresh seed would give other masks).
    ref_loss = {r["step"]: r["loss"] for r in ref_log}
    assert [r["step"] for r in ref_log] == list(range(1, steps + 1))
    assert [r["loss"] for r in log] == [ref_loss[r["step"]] for r in log]
    assert len(set(ref_loss.values())) == steps

    # Every step, replayed ones included, trained on the same samples on the same ranks.
    ref_rec, run_rec = sample_records(str(tmp_path / "ref_samples")), sample_records(str(tmp_path / "run_samples"))
    def key(r):
        return r["step"], r["rank"]

    ref_by = {key(r): r["ids"] for r in ref_rec}
    assert len(ref_by) == 2 * steps
    assert all(r["ids"] == ref_by[key(r)] for r in run_rec) and len(run_rec) == 2 * (7 + 8)

    # The final weights, optimizer state, RNG rows and loader position are bit-identical.
    a, b = os.path.join(ref_root, step_folder(steps)), os.path.join(run_root, step_folder(steps))
    ma, mb = sp.read_manifest(a), sp.read_manifest(b)
    assert sorted(ma.tensors) == sorted(mb.tensors) and len(ma.tensors) > 20
    assert {"rng.rows_w2.torch", "rng.rows_w2.python", "rng.rows_w2.numpy"} <= set(ma.tensors)
    diff = [n for n in ma.tensors if not torch.equal(sp.read_tensor(a, n), sp.read_tensor(b, n))]
    assert diff == []
    assert ma.values["extra"] == mb.values["extra"] == {"step": steps}
    assert ma.values["data"] == mb.values["data"] and ma.values["data"]["position"] == steps * GLOBAL_BATCH
    # Dropout really drew from the torch generators: their rows moved between steps 4 and 12.
    rows4 = sp.read_tensor(os.path.join(ref_root, step_folder(4)), "rng.rows_w2.torch")
    assert not any(torch.equal(rows4[r], sp.read_tensor(a, "rng.rows_w2.torch")[r]) for r in range(2))


@pytest.mark.slow
def test_relaunch_on_fewer_ranks_loses_and_repeats_no_sample(tmp_path):
    steps = 16
    n = steps * GLOBAL_BATCH  # one epoch
    root, log_path, samples = str(tmp_path / "run"), str(tmp_path / "loss.jsonl"), str(tmp_path / "samples")

    # 4 FSDP2 ranks; rank 3 dies after step 10 and there is no restart: the job fails.
    _, log4 = torchrun(root, log_path, samples, steps=steps, nproc=4, n_samples=n,
                          env={"KILL_AT_STEP": "10", "KILL_RANK": "3"}, expect_ok=False)
    assert [r["step"] for r in log4] == list(range(1, 11)) and {r["world"] for r in log4} == {4}
    mgr = CheckpointManager(root, policies=[OnDemand()])
    complete = mgr.steps()
    mgr.close()
    assert complete and max(complete) in (8, 4), complete  # saves every 4 steps; 8 unless still in flight
    resume = max(complete)

    # Relaunch on 2 ranks: resumes from the newest complete checkpoint, at its global data position.
    out2, log = torchrun(root, log_path, samples, steps=steps, nproc=2, n_samples=n)
    assert f"resumed after step {resume} (data epoch 0 position {resume * GLOBAL_BATCH})" in out2, out2
    log2 = log[len(log4):]
    assert [r["step"] for r in log2] == list(range(resume + 1, steps + 1)) and {r["world"] for r in log2} == {2}

    # Consumed samples: the 4-rank launch up to the checkpoint, then the 2-rank launch. Over the
    # epoch every sample is used exactly once; the 4-rank steps after the checkpoint were replayed
    # by the 2-rank launch on the same samples (the global order does not depend on the ranks).
    rec = sample_records(samples)
    assert all(r["epoch"] == 0 for r in rec)
    before = ids_per_step(rec, lambda r: r["world"] == 4)
    after = ids_per_step(rec, lambda r: r["world"] == 2)
    assert sorted(before) == list(range(1, 11)) and sorted(after) == list(range(resume + 1, steps + 1))
    assert all(len(v) == GLOBAL_BATCH for v in [*before.values(), *after.values()])
    used = [i for s in range(1, resume + 1) for i in before[s]] + [i for s in after for i in after[s]]
    assert sorted(used) == list(range(n)), "a sample was lost or repeated across the relaunch"
    assert all(before[s] == after[s] for s in range(resume + 1, 11))

    # Losses continue sensibly: a replayed step has the same samples, other dropout masks
    # (ranks 0-1 keep their streams, the data split differs), so its loss is close, not equal.
    loss4 = {r["step"]: r["loss"] for r in log4}
    loss2 = {r["step"]: r["loss"] for r in log2}
    for s in range(resume + 1, 11):
        assert abs(loss2[s] - loss4[s]) < 0.15 * loss4[s], (s, loss4[s], loss2[s])
    assert max(loss2[s] for s in range(steps - 2, steps + 1)) < loss4[1] - 0.5, (loss4, loss2)

    # The final checkpoint holds the 2-rank RNG rows and the end-of-epoch data position.
    m = sp.read_manifest(os.path.join(root, step_folder(steps)))
    assert {"rng.rows_w2.torch", "rng.rows_w2.python", "rng.rows_w2.numpy"} <= set(m.tensors)
    assert m.values["data"]["position"] == n and m.values["data"]["epoch"] == 0
