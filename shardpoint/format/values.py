"""Safe encoding of non-tensor values into the JSON manifest.

JSON covers ``None``, bools, ints, finite floats, strings, lists and
string-keyed dicts. Everything else that training state commonly holds gets a
tagged object ``{"__sp__": TAG, ...}``:

========== ===========================================================
tag        meaning
========== ===========================================================
``float``  non-finite float: ``{"v": "nan" | "inf" | "-inf"}``
``tuple``  ``{"v": [items]}``
``dict``   a dict with non-string keys: ``{"items": [[k, v], ...]}``
``counter`` a ``collections.Counter``: ``{"items": [[k, v], ...]}``
``bytes``  ``{"b64": base64}``
``tensor`` a tensor stored as a logical tensor: ``{"key": fqn}``
``dtype``  a ``torch.dtype``: ``{"v": "float32"}``
``pickle`` opt-in only: ``{"b64": pickled}``; never decoded unless allowed
========== ===========================================================

A plain dict whose keys include ``"__sp__"`` is itself escaped as a ``dict``
tag, so user data can never be mistaken for a tag.
"""

from __future__ import annotations

import base64
import collections
import binascii
import math
import pickle
from typing import Any, Callable

import torch

from ..errors import FormatError, UnsupportedStateError

__all__ = ["encode_value", "decode_value", "MAX_DEPTH"]

MAX_DEPTH = 64
_TAG = "__sp__"


def encode_value(
    value: Any,
    path: str,
    on_tensor: Callable[[str, torch.Tensor], None],
    allow_pickle: bool = False,
    _depth: int = 0,
) -> Any:
    """Encode ``value`` (found at ``path``) as JSON-safe data.

    Tensors are handed to ``on_tensor(fqn, tensor)`` and replaced by a
    reference. Unknown objects raise ``UnsupportedStateError`` unless
    ``allow_pickle`` is set.
    """
    if _depth > MAX_DEPTH:
        raise UnsupportedStateError(f"value at {path!r} nests deeper than {MAX_DEPTH} levels")
    d = _depth + 1
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_TAG: "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        on_tensor(path, value)
        return {_TAG: "tensor", "key": path}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {_TAG: "tuple", "v": [encode_value(v, f"{path}.{i}", on_tensor, allow_pickle, d) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{path}.{i}", on_tensor, allow_pickle, d) for i, v in enumerate(value)]
    if isinstance(value, collections.Counter):
        items = [
            [encode_value(k, f"{path}.<key>", on_tensor, allow_pickle, d), encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d)]
            for k, v in value.items()
        ]
        return {_TAG: "counter", "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise UnsupportedStateError(f"dict key {k!r} at {path!r} is not a str/int/float/bool/tuple")
            items.append([encode_value(k, f"{path}.<key>", on_tensor, allow_pickle, d), encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d)])
        return {_TAG: "dict", "items": items}
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return encode_value(value.item(), path, on_tensor, allow_pickle, d)
        if isinstance(value, np.ndarray):
            return encode_value(torch.from_numpy(np.ascontiguousarray(value)), path, on_tensor, allow_pickle, d)
    except ImportError:  # pragma: no cover - numpy is a hard dependency
        pass
    if allow_pickle:
        return {_TAG: "pickle", "b64": base64.b64encode(pickle.dumps(value)).decode("ascii")}
    raise UnsupportedStateError(
        f"cannot encode {type(value).__qualname__} at {path!r} safely; convert it to plain "
        "data (numbers, strings, lists, dicts, tensors) or pass allow_pickle=True"
    )


def decode_value(
    doc: Any,
    get_tensor: Callable[[str], Any],
    allow_pickle: bool = False,
    where: str = "<checkpoint>",
    _depth: int = 0,
) -> Any:
    """Decode data written by :func:`encode_value`; tensors come from ``get_tensor(fqn)``."""
    if _depth > MAX_DEPTH:
        raise FormatError(f"{where}: value nests deeper than {MAX_DEPTH} levels")
    d = _depth + 1
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [decode_value(v, get_tensor, allow_pickle, where, d) for v in doc]
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: unexpected JSON value {type(doc).__name__}")
    tag = doc.get(_TAG)
    if tag is None:
        return {k: decode_value(v, get_tensor, allow_pickle, where, d) for k, v in doc.items()}
    if tag == "float":
        v = _field(doc, "v", str, tag, where)
        if v not in ("nan", "inf", "-inf"):
            raise FormatError(f"{where}: bad float tag {v!r}")
        return float(v)
    if tag == "tuple":
        return tuple(decode_value(v, get_tensor, allow_pickle, where, d) for v in _field(doc, "v", list, tag, where))
    if tag in ("dict", "counter"):
        out = {} if tag == "dict" else collections.Counter()
        for pair in _field(doc, "items", list, tag, where):
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatError(f"{where}: malformed dict item")
            k = decode_value(pair[0], get_tensor, allow_pickle, where, d)
            try:
                out[k] = decode_value(pair[1], get_tensor, allow_pickle, where, d)
            except TypeError:
                raise FormatError(f"{where}: unhashable dict key") from None
        return out
    if tag == "bytes":
        return _b64(_field(doc, "b64", str, tag, where), where)
    if tag == "tensor":
        return get_tensor(_field(doc, "key", str, tag, where))
    if tag == "dtype":
        name = _field(doc, "v", str, tag, where)
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise FormatError(f"{where}: unknown dtype {name!r}")
        return dt
    if tag == "pickle":
        if not allow_pickle:
            raise FormatError(
                f"{where}: holds a pickled value; pass allow_pickle=True only if you trust this checkpoint"
            )
        return pickle.loads(_b64(_field(doc, "b64", str, tag, where), where))
    raise FormatError(f"{where}: unknown value tag {tag!r}")


def _field(doc: dict, name: str, typ: type, tag: str, where: str) -> Any:
    v = doc.get(name)
    if not isinstance(v, typ):
        raise FormatError(f"{where}: malformed {tag!r} value: field {name!r} must be a {typ.__name__}, got {v!r}")
    return v


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise FormatError(f"{where}: malformed base64 data in a value") from None
