"""Automatic restart under torchrun: a run whose rank is SIGKILLed mid-way, restarted by the
elastic agent and resumed by CheckpointManager, ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.manager import step_folder

pytestmark = pytest.mark.dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "train_elastic.py")
STEPS = 12


def torchrun(root: str, log: str, nproc: int = 2, restarts: int = 0, env: dict | None = None, layout: str = "fsdp2"):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, e.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}", SCRIPT, "--root", root, "--steps", str(STEPS), "--interval", "4",
        "--layout", layout, "--loss-log", log,
    ]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout, [json.loads(line) for line in open(log)]


def test_killed_rank_restarts_and_resumes_bit_exact(tmp_path):
    ref_root, run_root = str(tmp_path / "uninterrupted"), str(tmp_path / "interrupted")
    _, ref_log = torchrun(ref_root, str(tmp_path / "ref.jsonl"))
    out, log = torchrun(run_root, str(tmp_path / "run.jsonl"), restarts=2, env={"KILL_AT_STEP": "7", "KILL_RANK": "1"})

    # The first attempt died after step 7; the agent restarted it, and it resumed from a checkpoint.
    first = [r["step"] for r in log if r["attempt"] == 0]
    second = [r["step"] for r in log if r["attempt"] == 1]
    assert first == list(range(1, 8)), first
    assert second and second[-1] == STEPS and second == list(range(second[0], STEPS + 1)), second
    assert second[0] - 1 in (4,), f"resumed after step {second[0] - 1}, expected 4\n{out}"
    assert "killed by SIGKILL" in out and "resumed after step 4" in out

    # Every loss, replayed steps included, equals the uninterrupted run's, bit for bit.
    ref_loss = {r["step"]: r["loss"] for r in ref_log}
    assert [r["step"] for r in ref_log] == list(range(1, STEPS + 1))
    assert all(r["loss"] == ref_loss[r["step"]] for r in log)

    # The final weights and optimizer state are bit-identical.
    a, b = os.path.join(ref_root, step_folder(STEPS)), os.path.join(run_root, step_folder(STEPS))
    ma, mb = sp.read_manifest(a), sp.read_manifest(b)
    assert sorted(ma.tensors) == sorted(mb.tensors) and len(ma.tensors) > 20
    diff = [n for n in ma.tensors if not torch.equal(sp.read_tensor(a, n), sp.read_tensor(b, n))]
    assert diff == []
    assert ma.values["extra"] == mb.values["extra"]
