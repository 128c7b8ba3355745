"""Safe encoding of the Python types hyperparameters commonly hold, for framework checkpoints.

shardpoint stores plain values (numbers, strings, lists, dicts, tuples,
bytes, ``torch.dtype``) without pickle. Hyperparameters saved by a
framework often hold a few more types; :func:`encode_plain` turns them into
tagged plain dicts and :func:`decode_plain` rebuilds them, again without
pickle:

============ =================================================================
type         stored as
============ =================================================================
paths        ``pathlib`` paths, pure ones included (the class and the text)
Enum         a member of an ``Enum`` class (the class and the member's name)
dataclass    an instance whose fields are themselves encodable
namedtuple   the class and its items
Namespace    an ``argparse.Namespace`` (its attributes)
device       a ``torch.device``
============ =================================================================

A class named by a checkpoint (an Enum, a dataclass, a namedtuple) is only
looked up in modules already imported, never imported because a checkpoint
asks for it, and it must be the kind of class its tag says; with
``allow_pickle=True`` (you trust the checkpoint) its module is imported if
need be. Values of any other type are left alone: the checkpoint's own
encoding pickles them when pickle is allowed and refuses them otherwise.

Example::

    doc = encode_plain({"root": Path("/data"), "device": torch.device("cpu")}, "hyper_parameters")
    assert decode_plain(doc) == {"root": Path("/data"), "device": torch.device("cpu")}
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import pathlib
import sys
from typing import Any

import torch

from ..errors import FormatError

__all__ = ["TYPE_TAG", "encode_plain", "decode_plain", "class_name"]

TYPE_TAG = "__shardpoint_type__"
"""The key that marks a tagged value; a user dict holding this key is escaped (tag ``dict``)."""

_PATHS = {c.__name__: c for c in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath)}
_CONCRETE_PATHS = ("Path", "PosixPath", "WindowsPath")  # rebuilt as this system's concrete Path


def class_name(cls: type) -> str | None:
    """``"module:qualname"`` of ``cls``, or ``None`` when that name does not lead back to it (a class made in a function).

    Example::

        class_name(pathlib.Path)  # 'pathlib:Path'
    """
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    found = _lookup(sys.modules.get(module), qualname)
    return f"{module}:{qualname}" if found is cls else None


def encode_plain(value: Any, path: str) -> Any:
    """``value`` with every path, Enum member, dataclass, namedtuple, Namespace and device replaced by a tagged dict.

    Containers are copied only where something inside them changed, so
    tensors and untouched dicts keep their identity. ``path`` names where
    ``value`` sits, for messages.

    Example::

        encode_plain([Path("a")], "x")  # [{'__shardpoint_type__': 'path', 'class': 'PosixPath', 'v': 'a'}]
    """
    return _encode(value, path, 0)


def _encode(value: Any, path: str, depth: int) -> Any:
    if depth > 64 or value is None or isinstance(value, (bool, float, torch.Tensor, torch.dtype, bytes)):
        return value
    if isinstance(value, enum.Enum):  # before str and int: a str- or int-Enum is also one of those
        name = class_name(type(value))
        if name is None or type(value).__members__.get(value.name) is not value:
            return value
        return {TYPE_TAG: "enum", "class": name, "name": value.name}
    if isinstance(value, (str, int)):
        return value
    if isinstance(value, pathlib.PurePath):
        return {TYPE_TAG: "path", "class": type(value).__name__, "v": str(value)}
    if isinstance(value, torch.device):
        return {TYPE_TAG: "device", "v": str(value)}
    if isinstance(value, argparse.Namespace):
        return {TYPE_TAG: "namespace", "v": _encode(dict(vars(value)), path, depth + 1)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, path, depth)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        name = class_name(type(value))
        if name is None:
            return value
        return {TYPE_TAG: "namedtuple", "class": name, "v": [_encode(v, f"{path}.{i}", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}.{i}", depth + 1) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return _encode_dict(value, path, depth)
    return value


def _encode_dict(value: dict, path: str, depth: int) -> Any:
    out = {k: _encode(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    keys = [_encode(k, f"{path}.<key>", depth + 1) for k in value]
    if TYPE_TAG in value or any(isinstance(k, dict) for k in keys):
        # A key that itself needs a tag (an Enum member, a path): stored as pairs.
        return {TYPE_TAG: "dict", "items": [[k, out[orig]] for k, orig in zip(keys, value)]}
    if all(out[k] is value[k] for k in value):
        return value
    if type(value) is dict:
        return out
    copy = dict(value)
    copy.update(out)
    return copy


def _encode_dataclass(value: Any, path: str, depth: int) -> Any:
    cls = type(value)
    name = class_name(cls)
    fields = dataclasses.fields(value)
    init = {f.name for f in fields if f.init}
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if name is None or {p.name for p in params} != init:  # InitVar arguments cannot be rebuilt from the fields
        return value
    return {
        TYPE_TAG: "dataclass",
        "class": name,
        "fields": {f.name: _encode(getattr(value, f.name), f"{path}.{f.name}", depth + 1) for f in fields},
    }


def decode_plain(value: Any, allow_pickle: bool = False, where: str = "<checkpoint>") -> Any:
    """Rebuild what :func:`encode_plain` tagged; everything else is returned as it is.

    With ``allow_pickle`` a class's module is imported if it is not yet;
    otherwise a class in a module not imported raises
    :class:`~shardpoint.errors.FormatError` naming it.

    Example::

        decode_plain({"__shardpoint_type__": "device", "v": "cpu"})  # device(type='cpu')
    """
    return _decode(value, allow_pickle, where, 0)


def _decode(value: Any, allow_pickle: bool, where: str, depth: int) -> Any:
    if depth > 64:
        return value
    d = depth + 1
    if isinstance(value, (list, tuple)):
        items = [_decode(v, allow_pickle, where, d) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if not isinstance(value, dict):
        return value
    tag = value.get(TYPE_TAG)
    if tag is None:
        out = {k: _decode(v, allow_pickle, where, d) for k, v in value.items()}
        return value if all(out[k] is value[k] for k in value) else out
    return _decode_tagged(tag, value, allow_pickle, where, d)


def _decode_tagged(tag: Any, doc: dict, allow_pickle: bool, where: str, d: int) -> Any:
    if tag == "path":
        kind = _text(doc, "class", where)
        cls = pathlib.Path if kind in _CONCRETE_PATHS else _PATHS.get(kind)
        if cls is None:
            raise FormatError(f"{where}: unknown path class {kind!r}")
        return cls(_text(doc, "v", where))
    if tag == "device":
        try:
            return torch.device(_text(doc, "v", where))
        except RuntimeError as e:
            raise FormatError(f"{where}: malformed device {doc.get('v')!r}: {e}") from None
    if tag == "namespace":
        return argparse.Namespace(**_decode(doc.get("v") or {}, allow_pickle, where, d))
    if tag == "dict":
        pairs = doc.get("items")
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise FormatError(f"{where}: malformed tagged dict")
        return {_decode(k, allow_pickle, where, d): _decode(v, allow_pickle, where, d) for k, v in pairs}
    if tag == "enum":
        cls = _class(doc, allow_pickle, where, lambda c: isinstance(c, type) and issubclass(c, enum.Enum), "an Enum")
        member = cls.__members__.get(_text(doc, "name", where))
        if member is None:
            raise FormatError(f"{where}: {cls.__qualname__} has no member {doc.get('name')!r}")
        return member
    if tag == "namedtuple":
        cls = _class(doc, allow_pickle, where, lambda c: isinstance(c, type) and issubclass(c, tuple) and hasattr(c, "_fields"), "a namedtuple")
        return cls(*_decode(doc.get("v") or [], allow_pickle, where, d))
    if tag == "dataclass":
        return _decode_dataclass(doc, allow_pickle, where, d)
    raise FormatError(f"{where}: unknown value type {tag!r}")


def _decode_dataclass(doc: dict, allow_pickle: bool, where: str, d: int) -> Any:
    cls = _class(doc, allow_pickle, where, lambda c: isinstance(c, type) and dataclasses.is_dataclass(c), "a dataclass")
    saved = doc.get("fields")
    if not isinstance(saved, dict):
        raise FormatError(f"{where}: malformed dataclass {cls.__qualname__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if set(saved) != set(fields):
        raise FormatError(
            f"{where}: dataclass {cls.__qualname__} now has fields {sorted(fields)}, the checkpoint {sorted(saved)}"
        )
    values = {k: _decode(v, allow_pickle, where, d) for k, v in saved.items()}
    obj = cls(**{k: v for k, v in values.items() if fields[k].init})
    for k, v in values.items():
        if not fields[k].init:  # a field __init__ does not take: set as saved (frozen ones included)
            object.__setattr__(obj, k, v)
    return obj


def _class(doc: dict, allow_pickle: bool, where: str, kind_ok: Any, kind: str) -> type:
    spec = _text(doc, "class", where)
    module, _, qualname = spec.partition(":")
    mod = sys.modules.get(module)
    if mod is None and allow_pickle:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise FormatError(f"{where}: cannot import module {module!r} of class {qualname}: {e}") from None
    if mod is None:
        raise FormatError(
            f"{where}: the checkpoint holds a value of class {qualname} from module {module!r}, which is not "
            "imported; import that module before loading (classes are never imported because a checkpoint "
            "names them), or load with allow_pickle=True if you trust this checkpoint"
        )
    cls = _lookup(mod, qualname)
    if not kind_ok(cls):
        raise FormatError(f"{where}: {spec} is not {kind} in this program")
    return cls


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _text(doc: dict, name: str, where: str) -> str:
    v = doc.get(name)
    if not isinstance(v, str):
        raise FormatError(f"{where}: malformed tagged value: field {name!r} must be a string, got {v!r}")
    return v
