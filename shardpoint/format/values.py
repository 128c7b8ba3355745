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
``ndarray`` a numpy array: ``{"dtype": "<f4", "key": fqn}`` (its data stored as
           a logical tensor), or, for a dtype torch lacks (strings,
           byte-swapped), ``{"dtype": "<U3", "shape": [2], "b64": raw bytes}``
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
import re
from typing import Any, Callable

import numpy as np
import torch

from ..errors import FormatError, UnsupportedStateError
from .manifest import DTYPE_SIZES

__all__ = ["encode_value", "decode_value", "check_optimizer_doc", "MAX_DEPTH", "MAX_INT_DIGITS"]

MAX_DEPTH = 64
# Integers outside int64 are stored as decimal text (tag "int"), at most this many digits.
MAX_INT_DIGITS = 1000
_INT64 = (-(1 << 63), (1 << 63) - 1)
VALUE_TAG = "__sp__"  # the key marking an encoded value (int, float, tensor, tuple...) in a value document


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
        v = int(value)
        if _INT64[0] <= v <= _INT64[1]:
            return v
        text = str(v) if abs(v).bit_length() < 3300 else ""
        if not text or len(text) > MAX_INT_DIGITS:
            raise UnsupportedStateError(f"integer at {path!r} has more than {MAX_INT_DIGITS} digits")
        return {VALUE_TAG: "int", "v": text}
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {VALUE_TAG: "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        on_tensor(path, value)
        return {VALUE_TAG: "tensor", "key": path}
    if isinstance(value, torch.dtype):
        return {VALUE_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, (bytes, bytearray)):
        return {VALUE_TAG: "bytes", "b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {VALUE_TAG: "tuple", "v": [encode_value(v, f"{path}.{i}", on_tensor, allow_pickle, d) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{path}.{i}", on_tensor, allow_pickle, d) for i, v in enumerate(value)]
    if isinstance(value, collections.Counter):
        items = [
            [encode_value(k, f"{path}.<key>", on_tensor, allow_pickle, d), encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d)]
            for k, v in value.items()
        ]
        return {VALUE_TAG: "counter", "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and VALUE_TAG not in value:
            return {k: encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise UnsupportedStateError(f"dict key {k!r} at {path!r} is not a str/int/float/bool/tuple")
            items.append([encode_value(k, f"{path}.<key>", on_tensor, allow_pickle, d), encode_value(v, f"{path}.{k}", on_tensor, allow_pickle, d)])
        return {VALUE_TAG: "dict", "items": items}
    if isinstance(value, np.generic):
        return encode_value(value.item(), path, on_tensor, allow_pickle, d)
    if isinstance(value, np.ndarray) and _NDARRAY_DTYPE.fullmatch(value.dtype.str):
        return _encode_ndarray(value, path, on_tensor)
    if allow_pickle:
        return {VALUE_TAG: "pickle", "b64": base64.b64encode(pickle.dumps(value)).decode("ascii")}
    raise UnsupportedStateError(
        f"cannot encode {type(value).__qualname__} at {path!r} safely; convert it to plain "
        "data (numbers, strings, lists, dicts, tensors) or pass allow_pickle=True"
    )


# Fixed-size numpy dtypes whose ``dtype.str`` names them completely (no object or structured dtypes):
# bool, integers, floats, complex, bytes, unicode, timedelta and datetime, in either byte order.
_NDARRAY_DTYPE = re.compile(r"[<>|=][biufcSUmM][0-9]{1,4}(\[[0-9]*[a-zA-Z]{1,3}\])?")


def _encode_ndarray(value: np.ndarray, path: str, on_tensor: Callable[[str, torch.Tensor], None]) -> dict:
    """A numpy array: its data as a logical tensor when torch has its dtype, else inline bytes."""
    arr = value if value.flags.c_contiguous else np.ascontiguousarray(value).reshape(value.shape)
    try:
        t = torch.from_numpy(arr)
    except (TypeError, ValueError):  # a dtype torch lacks: strings, datetimes, a non-native byte order
        t = None
    if t is None or str(t.dtype).removeprefix("torch.") not in DTYPE_SIZES:  # nor the format (uint32)
        raw = arr.tobytes()
        return {VALUE_TAG: "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape), "b64": base64.b64encode(raw).decode("ascii")}
    on_tensor(path, t)
    return {VALUE_TAG: "ndarray", "dtype": arr.dtype.str, "key": path}


def _decode_ndarray(doc: dict, get_tensor: Callable[[str], Any], where: str) -> Any:
    text = _field(doc, "dtype", str, "ndarray", where)
    if not _NDARRAY_DTYPE.fullmatch(text):
        raise FormatError(f"{where}: malformed 'ndarray' value: dtype {text[:40]!r} is not a fixed-size numpy dtype")
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise FormatError(f"{where}: malformed 'ndarray' value: unknown dtype {text[:40]!r}") from None
    if "key" in doc:
        t = get_tensor(_field(doc, "key", str, "ndarray", where))
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or type(t) is not torch.Tensor:
            return t  # missing, or loaded into a caller's tensor of another kind: left as it is
        arr = t.numpy()  # shares the tensor's memory, which the load fills in afterwards
        if arr.dtype != dtype:
            raise FormatError(f"{where}: 'ndarray' value of dtype {text} is stored as a {arr.dtype} tensor")
        return arr
    shape = _field(doc, "shape", list, "ndarray", where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FormatError(f"{where}: malformed 'ndarray' value: shape {shape!r}")
    raw = _b64(_field(doc, "b64", str, "ndarray", where), where)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise FormatError(f"{where}: 'ndarray' value holds {len(raw)} bytes, its shape and dtype need {math.prod(shape) * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


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
    tag = doc.get(VALUE_TAG)
    if tag is None:
        return {k: decode_value(v, get_tensor, allow_pickle, where, d) for k, v in doc.items()}
    if tag == "float":
        v = _field(doc, "v", str, tag, where)
        if v not in ("nan", "inf", "-inf"):
            raise FormatError(f"{where}: bad float tag {v!r}")
        return float(v)
    if tag == "int":
        text = _field(doc, "v", str, tag, where)
        if len(text) > MAX_INT_DIGITS + 1 or not re.fullmatch(r"-?[0-9]+", text):
            raise FormatError(f"{where}: malformed 'int' value {text[:40]!r}")
        return int(text)
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
    if tag == "ndarray":
        return _decode_ndarray(doc, get_tensor, where)
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


def check_optimizer_doc(doc: Any, where: str) -> tuple[dict, list, dict]:
    """Validate an optimizer's value document; return its ``(state, groups, group_of)``.

    The document is ``{"groups": [hyper-parameter object, ...], "group_of":
    {parameter name: group index}, "state": {parameter name: state object}}``.
    Other fields (a framework's own, like ``deepspeed``) are left to their
    adapter. Every field is checked before the load uses any of it: a missing
    document or field, a group that is not an object or names ``params``, a
    ``group_of`` entry that is not an integer index of ``groups``, and a
    state entry that is not an object each raise ``FormatError`` naming the
    field (``where`` names the checkpoint and entry).

    Example::

        state, groups, group_of = check_optimizer_doc(manifest.values["optim"], "ckpt: entry 'optim'")
    """
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: the optimizer's value document is missing or not an object (got {type(doc).__name__})")
    for name in ("groups", "group_of", "state"):
        if name not in doc:
            raise FormatError(f"{where}: the optimizer's value document lacks its field {name!r}")
    groups, group_of, state = doc.get("groups"), doc.get("group_of"), doc.get("state")
    if not isinstance(groups, list):
        raise FormatError(f"{where}: field 'groups' must be a list of objects, got {type(groups).__name__}")
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or VALUE_TAG in g:
            raise FormatError(f"{where}: field 'groups.{i}' must be an object of hyper-parameters, got {type(g).__name__}")
        if "params" in g:
            raise FormatError(f"{where}: field 'groups.{i}' must not hold 'params'")
    if not isinstance(group_of, dict):
        raise FormatError(f"{where}: field 'group_of' must be an object, got {type(group_of).__name__}")
    for name, gi in group_of.items():
        if not isinstance(gi, int) or isinstance(gi, bool) or not 0 <= gi < len(groups):
            raise FormatError(
                f"{where}: field 'group_of.{name}' must be a group index in [0, {len(groups)}), got {gi!r}"
            )
    if not isinstance(state, dict):
        raise FormatError(f"{where}: field 'state' must be an object, got {type(state).__name__}")
    for name, s in state.items():
        if not isinstance(s, dict):
            raise FormatError(f"{where}: field 'state.{name}' must be an object, got {type(s).__name__}")
    return state, groups, group_of


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
