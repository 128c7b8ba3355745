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


def test_torchtitan_runs_says_whether_torchtitan_imports_on_this_torch():
    pytest.importorskip("torchtitan")
    from shardpoint.runtime import torchcompat

    try:
        import torchtitan.components.checkpointer  # noqa: F401
        imports = True
    except ImportError:  # torchtitan 0.3.0 on a torch older than it needs
        imports = False
    assert torchcompat.torchtitan_runs() is imports


def test_torchtitan_on_an_older_torch_names_the_torch_it_needs():
    pytest.importorskip("torchtitan")
    # The detection is forced, so the error path runs on whichever torch the suite has.
    done = _python(
        "from shardpoint.runtime import torchcompat\n"
        "torchcompat.torchtitan_runs = lambda: False\n"
        "import shardpoint as sp\n"
        "try:\n"
        "    import shardpoint.integrations.torchtitan\n"
        "except sp.UnsupportedStateError as e:\n"
        "    print('typed', e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("typed torchtitan 0.3.0 needs torch 2.11 or later, and this is torch ")
    assert "pip install 'torch>=2.11'" in done.stdout
