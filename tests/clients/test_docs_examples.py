"""The user guides' examples run as written.

Every ```python block of a page runs, in order, as one script in a fresh folder
(```py blocks are fragments that need a cluster, a GPU or names the page leaves out).
The torchrun recipe of the getting-started page runs under torchrun on 2 ranks, then
resumes on 1 rank from the checkpoints the 2 ranks wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from shardpoint.runtime import torchcompat

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")


def blocks(page: str, fence: str = "python") -> list[str]:
    """The code blocks of ``page`` (relative to docs/) fenced with ``fence``, in order."""
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    return re.findall(rf"^```{fence}\n(.*?)^```", text, re.S | re.M)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("page", ["getting-started.md", "manager.md", "guides/resharding.md", "guides/configuration.md", "guides/async.md", "guides/conversion.md", "guides/migrating-from-dcp.md", "guides/incremental.md"])
def test_page_examples_run(page, tmp_path):
    code = blocks(page)
    assert code, f"{page} has no runnable example"
    path = tmp_path / "example.py"
    path.write_text("\n".join(code))
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}: example failed\n{done.stderr[-4000:]}"


def test_torchrun_recipe_resumes_on_another_number_of_ranks(tmp_path):
    script = [b for b in blocks("getting-started.md", "py") if b.startswith("# train.py")]
    assert len(script) == 1
    # On CPU, torch 2.6's FSDP2 needs the test aid that shardpoint's own launcher applies (a no-op from 2.7).
    aid = "" if torchcompat.HAS_CPU_FSDP2 else "from shardpoint.runtime import torchcompat\ntorchcompat.enable_cpu_fsdp2()\n"
    (tmp_path / "train.py").write_text(aid + script[0])
    manifest = tmp_path / "ckpt" / "run" / "step_00000030" / "manifest.json"
    saved = None
    for nproc, start in ((2, 0), (1, 30)):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, f"torchrun with {nproc} rank(s) failed\n{done.stderr[-4000:]}"
        assert f"starting at step {start}\n" in done.stdout
        assert "done at step 30 checkpoints: [20, 30]" in done.stdout
        if saved is None:
            saved = manifest.read_bytes()
    # the 1-rank launch resumed from the 2 ranks' step 30 instead of training (and saving) afresh
    assert manifest.read_bytes() == saved
    assert sorted(p.name for p in manifest.parent.parent.iterdir() if p.name.startswith("step_")) == [
        "step_00000020", "step_00000030"]
