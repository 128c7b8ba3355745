"""Static check: every adapter under ``adapters/`` derives from :class:`shardpoint.adapters.Adapter`.

The orchestrators call adapters only through the methods the base class
declares, so a class named ``...Adapter`` that does not derive from it
would be an adapter the registry cannot vouch for.
"""

from __future__ import annotations

import ast
import pathlib

import shardpoint
from shardpoint.adapters import Adapter, default_adapters

ADAPTERS = pathlib.Path(shardpoint.__file__).resolve().parent / "adapters"


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for b in node.bases:
        text = ast.unparse(b)
        names.append(text.rsplit(".", 1)[-1])
    return names


def adapters_not_deriving(root: pathlib.Path = ADAPTERS) -> list[str]:
    """``"path: Class"`` for each class named ``...Adapter`` that does not derive from ``Adapter``.

    A class derives when one of its bases is ``Adapter`` or, by name, another
    class of the package that derives.
    """
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (str(path.relative_to(root)), _base_names(node))

    def derives(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "Adapter":
            return True
        if name in seen or name not in classes:
            return False
        return any(derives(b, seen | {name}) for b in classes[name][1])

    return sorted(f"{where}: {name}" for name, (where, _) in classes.items()
                  if name.endswith("Adapter") and name != "Adapter" and not derives(name))


def test_every_adapter_class_derives_from_the_base_class():
    assert adapters_not_deriving() == []


def test_every_registered_adapter_is_an_adapter_with_a_unique_name():
    adapters = default_adapters()
    assert all(isinstance(a, Adapter) for a in adapters)
    names = [a.name for a in adapters]
    assert len(set(names)) == len(names) and names[-1] == "values"


def test_the_adapter_scan_finds_a_class_that_does_not_derive(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.py").write_text("class Adapter:\n    pass\n")
    (tmp_path / "good.py").write_text("from .base import Adapter\nclass GoodAdapter(Adapter):\n    pass\nclass FinerAdapter(GoodAdapter):\n    pass\n")
    (tmp_path / "sub" / "bad.py").write_text(
        "class LooseAdapter:\n    name = 'loose'\n"
        "class Helper:\n    pass\n"
        "class AlsoLooseAdapter(Helper):\n    pass\n"
    )
    assert adapters_not_deriving(tmp_path) == ["sub/bad.py: AlsoLooseAdapter", "sub/bad.py: LooseAdapter"]
