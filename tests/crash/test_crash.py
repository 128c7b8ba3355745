"""Crash tests with real processes and real signals: SIGKILL a rank at random points of a save.

Each iteration launches 2 gloo ranks (FSDP2) on one run root. The launch first
restores and checks the newest complete checkpoint bit for bit against an
independent reference, then trains and saves until the injected fault kills
one rank (during the snapshot, inside data writes, between the data and the
manifest, during the manifest commit, right after it, during retention
deletes or compaction, or at a random moment). After every kill the next launch must
restore exactly the newest committed step, and never a torn checkpoint.

The count is a parameter: ``SHARDPOINT_CRASH_ITERS`` (default 10) and
``SHARDPOINT_CRASH_SEED`` (default 0; the kill delays are timing-dependent
anyway). For a long soak::

    SHARDPOINT_CRASH_ITERS=200 pytest tests/crash -q
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import shardpoint as sp
from shardpoint.manager import step_folder
from shardpoint.manager.incremental import referenced_by
from shardpoint.storage import LocalStorage
from shardpoint.testing import build, full_state

from .crash_cases import CFG

pytestmark = pytest.mark.dist

ITERS = int(os.environ.get("SHARDPOINT_CRASH_ITERS", "10"))
SEED = int(os.environ.get("SHARDPOINT_CRASH_SEED", "0"))
PHASES = ["snapshot", "data", "manifest", "commit", "commit_done", "write", "committed", "retention", "anytime", "data"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK0_ONLY = {"manifest", "commit", "commit_done", "retention", "compact"}
# The incremental run also dies while retention moves referenced chunks into a smaller file (compaction).
INCREMENTAL_PHASES = ["snapshot", "compact", "manifest", "compact", "commit_done", "write", "compact", "retention", "anytime", "compact"]


def plan(rng: random.Random, i: int, modes: tuple = ("eager", "lazy", None), incremental: bool = False) -> tuple[str | None, dict]:
    phases = INCREMENTAL_PHASES if incremental else PHASES
    phase = phases[i] if i < len(phases) else rng.choice(phases)
    mode = rng.choice(modes)
    spec = {"phase": phase, "rank": 0 if phase in RANK0_ONLY else rng.randrange(2)}
    if phase == "snapshot":
        spec.update(nth=rng.randint(1, 3), delay=rng.uniform(0, 0.03))
    elif phase == "data":
        spec.update(nth=rng.randint(1, 12))
    elif phase == "write":
        spec.update(nth=rng.randint(1, 3), delay=rng.uniform(0, 0.25))
    elif phase in ("manifest", "commit", "commit_done", "committed"):
        spec.update(nth=rng.randint(1, 3))
    elif phase == "retention":
        spec.update(nth=rng.randint(1, 4))
    elif phase == "compact":  # before the new file, after it, before each manifest switch, before the old file goes
        spec.update(nth=rng.randint(1, 5))
    elif phase == "anytime":
        spec.update(delay=rng.uniform(0.05, 2.5))
    return mode, spec


@pytest.mark.parametrize("incremental,modes", [(False, ("eager", "lazy", None)), (True, (None,)), (True, ("eager", "lazy"))],
                         ids=["full", "incremental", "incremental-background"])
def test_sigkill_during_saves_never_loses_or_tears(tmp_path, incremental, modes):
    root, refs, checks = (str(tmp_path / d) for d in ("run", "refs", "checks"))
    for d in (refs, checks):
        os.makedirs(d)
    rng = random.Random(SEED)
    launches = []
    for i in range(ITERS + 1):
        mode, spec = plan(rng, i, modes, incremental) if i < ITERS else (modes[0], None)  # the last runs clean
        launches.append({"root": root, "refs": refs, "checks": checks, "it": i, "mode": mode, "fault": spec,
                         "incremental": incremental})
    plan_path = os.path.join(str(tmp_path), "plan.json")
    with open(plan_path, "w") as f:
        json.dump({"launches": launches}, f)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.crash.crash_cases", plan_path], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120 + 90 * len(launches),
    )
    assert proc.returncode == 0, proc.stderr[-6000:]

    fired, history = 0, []
    for args in launches:
        i = args["it"]
        with open(os.path.join(checks, f"launch_{i:04d}.json")) as f:
            ended = json.load(f)
        marker = os.path.join(checks, f"fired_{i:04d}.json")
        history.append((i, args["mode"], args["fault"], ended["status"], os.path.exists(marker), round(ended["seconds"], 1)))
        where = f"launch {i} (seed {SEED}); launches so far: {history}"
        check_path = os.path.join(checks, f"check_{i:04d}.json")
        assert os.path.exists(check_path), f"{where}: no restore check\n{ended['detail']}"
        with open(check_path) as f:
            check = json.load(f)
        # The restore took the newest committed step (no fallback past a torn one), bit-exact.
        assert check["restored"] == check["newest"], f"{where}: restored {check['restored']}, newest {check['newest']}"
        assert check["diff"] == [], f"{where}: restored state differs in {check['diff'][:5]}"
        assert check["replay"] == [], f"{where}: {check['replay']}"
        if ended["status"] != "ok":
            assert os.path.exists(marker), f"{where}: launch failed without an injected kill:\n{ended['detail']}"
            fired += 1
    assert history[-1][3] == "ok", history[-1]
    if incremental:  # the kills landed inside compaction too, not only in saves
        assert any(f and f["phase"] == "compact" and hit for _, _, f, _, hit, _ in history), history
    assert fired >= ITERS // 2, f"only {fired} of {ITERS} faults fired: {history}"

    # Every committed checkpoint left is complete and equals its reference; no garbage is left.
    st = LocalStorage(root)
    committed = sorted(int(n[5:13]) for n in st.list("") if n.endswith("/manifest.json") and n.startswith("step_"))
    assert len(committed) >= 2
    for s in committed:
        model, opt = build("single", CFG, seed=3)
        sp.load(st.child(step_folder(s)), {"model": model, "optimizer": opt})
        ref = load_file(os.path.join(refs, f"step_{s:08d}.safetensors"))
        got = full_state(model, opt)
        assert [k for k in ref if not torch.equal(ref[k], got[k])] == [], f"step {s}"
    folders = {n.split("/")[0] for n in st.list("") if n.startswith("step_")}
    leftovers = {f for f in folders if int(f[5:]) < committed[-1]} - {step_folder(s) for s in committed}
    if incremental:  # a removed step's data files stay while a kept step references them, and only those
        kept = referenced_by(st, committed) or {}
        assert any(kept.values()), "incremental saves referenced nothing"
        leftovers = {f for f in leftovers if not set(st.child(f).list("")) <= kept.get(f, set())}
    assert not leftovers, f"incomplete folders older than the newest checkpoint remain: {sorted(leftovers)}"
