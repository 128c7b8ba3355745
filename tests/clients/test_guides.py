"""The integration guides' examples run as written.

Every ```python block of a guide runs, in order, as one script in a fresh folder
(```py blocks are fragments that need a cluster or a framework's full setup).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "integrations")


def script(page: str) -> str:
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks, f"{page} has no runnable example"
    return "\n".join(blocks)


@pytest.mark.parametrize("page,needs", [("lightning.md", "lightning"), ("accelerate.md", "accelerate")])
def test_guide_examples_run(page, needs, tmp_path):
    pytest.importorskip(needs)
    path = tmp_path / "example.py"
    path.write_text(script(page))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}: example failed\n{done.stderr[-4000:]}"
