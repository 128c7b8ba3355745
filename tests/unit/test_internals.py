"""Internal packages say so, and the API reference gives every name a public spelling.

The public API is what ``shardpoint`` exports and what the API reference
documents. The packages below serve the other modules: their ``__all__``
lists what other shardpoint modules may import, not a promise to users.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import shardpoint

PKG = pathlib.Path(shardpoint.__file__).resolve().parent
REFERENCE = PKG.parent / "docs" / "reference" / "api.md"
INTERNAL = ("device", "engine", "format", "geometry", "loading", "planning", "saving")


def unmarked(root: pathlib.Path, packages=INTERNAL) -> list[str]:
    """Internal packages whose docstring does not begin with ``Internal:``."""
    out = []
    for name in packages:
        doc = ast.get_docstring(ast.parse((root / name / "__init__.py").read_text())) or ""
        if not doc.startswith("Internal:"):
            out.append(name)
    return out


def leaked(reference: str, public: set[str], packages=INTERNAL) -> list[str]:
    """Names the reference documents inside an internal package that ``shardpoint`` does not export."""
    out = []
    for path in re.findall(r"^::: (shardpoint\.[\w.]+)", reference, flags=re.M):
        parts = path.split(".")
        if len(parts) > 2 and parts[1] in packages and parts[-1] not in public:
            out.append(path)
    return out


def test_internal_packages_say_so():
    assert unmarked(PKG) == []


def test_the_reference_documents_no_internal_name_without_a_public_spelling():
    public = set(shardpoint.__all__)
    assert leaked(REFERENCE.read_text(), public) == []
    for path in re.findall(r"^::: (shardpoint\.[\w.]+)", REFERENCE.read_text(), flags=re.M):
        parts = path.split(".")
        if len(parts) > 2 and parts[1] in INTERNAL:  # the public spelling is the same object
            mod = importlib.import_module(".".join(parts[:-1]))
            assert getattr(shardpoint, parts[-1]) is getattr(mod, parts[-1]), path


def test_the_scans_find_planted_violations(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text('"""The engine."""\n')
    (tmp_path / "format").mkdir()
    (tmp_path / "format" / "__init__.py").write_text('"""Internal: the format."""\n')
    assert unmarked(tmp_path, ("engine", "format")) == ["engine"]
    ref = "::: shardpoint.save\n::: shardpoint.engine.claim.CommitPolicy\n::: shardpoint.planning.writers.choose_writers\n"
    assert leaked(ref, {"save", "CommitPolicy"}) == ["shardpoint.planning.writers.choose_writers"]
