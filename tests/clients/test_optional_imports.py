"""``import shardpoint`` needs no training framework, and a missing one gives a typed error with the install command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRAMEWORKS = {
    "lightning": "pip install 'shardpoint[lightning]'",
    "accelerate": "pip install 'shardpoint[accelerate]'",
    "transformers": "pip install 'shardpoint[transformers]'",
    "torchtitan": "pip install --no-deps torchtitan, then its requirements (see the torchtitan integration guide)",
}


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_import_shardpoint_needs_no_framework():
    done = _python(
        "import sys, shardpoint, shardpoint.integrations, shardpoint.integrations.common\n"
        f"print(sorted(m for m in {sorted(FRAMEWORKS)!r} if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module,hint", sorted(FRAMEWORKS.items()))
def test_missing_framework_raises_a_typed_error(module, hint):
    # sys.modules[name] = None makes `import name` fail, as if the package were not installed.
    done = _python(
        f"import sys; sys.modules[{module!r}] = None\n"
        "import shardpoint as sp\n"
        "try:\n"
        f"    import shardpoint.integrations.{module}\n"
        "except sp.MissingDependencyError as e:\n"
        "    print('typed', e.hint)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"typed {hint}"
