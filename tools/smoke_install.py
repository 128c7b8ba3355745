"""Checks an installed shardpoint from outside the source tree (run by `make package-check`).

Run it from a folder that holds no ``shardpoint`` package, with the venv that
has the wheel or sdist installed: it proves the import comes from there, that a
save and load round-trips bit for bit, that the manager resumes, and that a
missing extra gives the typed install hint.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch

import shardpoint as sp

here = os.path.dirname(sp.__file__)
assert "site-packages" in here, f"shardpoint imported from {here}, not from the installed package"
assert os.path.exists(os.path.join(here, "format", "manifest.py")), "the package lacks its subpackages"
assert os.path.exists(os.path.join(here, "py.typed")), "the package lacks its py.typed marker"
assert importlib.metadata.version("shardpoint") == sp.__version__, "the metadata and the package disagree on the version"

with tempfile.TemporaryDirectory() as root:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sp.save(os.path.join(root, "a"), {"model": model, "optimizer": opt, "extra": {"step": 1}})
    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optimizer": fresh_opt, "extra": {}}
    sp.load(os.path.join(root, "a"), state)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert state["extra"] == {"step": 1}
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])

    mgr = sp.CheckpointManager(os.path.join(root, "run"), interval=1, keep_last=2)
    for step in (1, 2, 3):
        mgr.maybe_save(step, {"model": model})
    mgr.wait()
    assert mgr.steps() == [2, 3], mgr.steps()
    again = torch.nn.Linear(8, 4)
    assert mgr.restore({"model": again}) == 3 and torch.equal(again.weight, model.weight)
    mgr.close()

    exe = os.path.join(os.path.dirname(sys.executable), "shardpoint")  # the console script of this venv
    cli = subprocess.run([exe, "inspect", os.path.join(root, "a"), "--json"], capture_output=True, text=True)
    assert cli.returncode == 0 and '"format_version"' in cli.stdout, cli.stderr
    cli = subprocess.run([sys.executable, "-m", "shardpoint", "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "usage: shardpoint" in cli.stdout and "``" not in cli.stdout, cli.stderr
    if importlib.util.find_spec("rich") is None:
        cli = subprocess.run([exe, "inspect", os.path.join(root, "a")], capture_output=True, text=True)
        assert cli.returncode == 2 and "pip install 'shardpoint[cli]'" in cli.stderr, cli.stderr
        print("without the cli extra: inspect names pip install 'shardpoint[cli]'")

print(f"installed shardpoint {sp.__version__} from {here}: save, load, manager and CLI work (torch {torch.__version__})")
sys.exit(0)
