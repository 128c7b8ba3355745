"""The safe value codec: JSON plus a few tags, pickle only on request."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.errors import FormatError, UnsupportedStateError
from shardpoint.format import decode_value, encode_value


def round_trip(value, allow_pickle=False):
    """Encode, pass through strict JSON text, decode. Returns (decoded, tensors, document)."""
    tensors: dict[str, torch.Tensor] = {}
    doc = encode_value(value, "root", tensors.__setitem__, allow_pickle)
    text = json.dumps(doc, allow_nan=False)
    back = decode_value(json.loads(text), tensors.__getitem__, allow_pickle, "ckpt")
    return back, tensors, doc


def same(a, b) -> bool:
    """Equality that also checks types, treats nan as equal and compares tensors bit-exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(2**62),
        2**70,
        1.5,
        -0.0,
        float("nan"),
        float("inf"),
        float("-inf"),
        "",
        "héllo\n\u2603",
        [1, [2, [3, []]]],
        {"a": {"b": [1, "x", None]}, "": 3},
        (1, "two", (3.0,), ()),
        [(1, 2), {"t": (None,)}],
        {1: "one", 2: "two"},
        {(1, 2): "pair", None: 0, 2.5: "f", True: "b"},
        {"x": 1, 3: "mixed keys"},
        b"\x00\xffbytes",
        b"",
        torch.float32,
        torch.bfloat16,
        torch.int64,
        {"__sp__": "tensor", "key": "not a tag"},
        {"__sp__": "pickle", "b64": "gAR9lC4="},
        [{"__sp__": 1, "v": 2}],
        {"betas": (0.9, 0.999), "lr": 1e-3, "fused": None, "dtype": torch.float16},
    ],
    ids=repr,
)
def test_round_trip(value):
    back, tensors, _ = round_trip(value)
    assert same(back, value), (back, value)
    assert tensors == {}


def test_special_floats_and_negative_zero():
    back, _, doc = round_trip([float("nan"), float("inf"), float("-inf"), -0.0])
    assert doc[:3] == [{"__sp__": "float", "v": "nan"}, {"__sp__": "float", "v": "inf"}, {"__sp__": "float", "v": "-inf"}]
    assert math.isnan(back[0]) and back[1] == math.inf and back[2] == -math.inf
    assert math.copysign(1.0, back[3]) == -1.0


def test_user_tag_key_is_escaped():
    value = {"__sp__": "pickle", "b64": "gAR9lC4="}
    doc = encode_value(value, "root", lambda *_: None)
    assert doc["__sp__"] == "dict"  # never mistaken for a real pickle tag
    assert decode_value(doc, lambda k: None) == value  # and decodes without allow_pickle


def test_bytearray_becomes_bytes():
    back, _, _ = round_trip(bytearray(b"abc"))
    assert back == b"abc" and type(back) is bytes


def test_numpy_scalars_and_arrays():
    back, tensors, _ = round_trip({"i": np.int64(7), "f": np.float32(0.5), "b": np.bool_(True), "a": np.arange(4, dtype=np.int16)})
    assert back["i"] == 7 and type(back["i"]) is int
    assert back["f"] == 0.5 and back["b"] is True
    assert list(tensors) == ["root.a"]
    assert isinstance(back["a"], np.ndarray) and back["a"].dtype == np.int16
    assert np.array_equal(back["a"], np.arange(4, dtype=np.int16))


NUMPY_CASES = {
    "int16_2d": np.arange(6, dtype=np.int16).reshape(2, 3),
    "float32_0d": np.array(1.5, dtype=np.float32),
    "float64_strided": np.arange(12.0).reshape(3, 4)[:, ::2],
    "bool": np.array([True, False, True]),
    "float16_empty": np.zeros((0, 3), np.float16),
    "complex64": np.array([1 + 2j, -3j], dtype=np.complex64),
    "uint32": np.array([0, 1, 2**32 - 1], dtype=np.uint32),  # no tensor dtype of the format: inline
    "big_endian": np.arange(4, dtype=">f8"),
    "unicode": np.array(["ab", "c"]),
    "bytes": np.array([b"xy", b"z"]),
    "datetime": np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
    "nan": np.array([np.nan, -0.0, np.inf], dtype=np.float32),
}


@pytest.mark.parametrize("name", sorted(NUMPY_CASES))
def test_numpy_arrays_round_trip_as_numpy_bit_exact(name):
    a = NUMPY_CASES[name]
    back, tensors, doc = round_trip({"a": a})
    out = back["a"]
    assert type(out) is np.ndarray
    assert out.dtype == a.dtype and out.shape == a.shape
    assert out.tobytes() == np.ascontiguousarray(a).tobytes()
    assert doc["a"]["__sp__"] == "ndarray" and doc["a"]["dtype"] == a.dtype.str
    # the data of dtypes the format stores goes into a tensor; the others are inline, never pickled
    assert ("key" in doc["a"]) == (list(tensors) == ["root.a"])
    assert "pickle" not in json.dumps(doc)


def test_numpy_array_tensor_data_is_shared_with_the_loaded_tensor():
    tensors = {}
    doc = encode_value(np.arange(3, dtype=np.int64), "x", tensors.__setitem__)
    dest = torch.zeros(3, dtype=torch.int64)
    arr = decode_value(doc, {"x": dest}.__getitem__)
    dest.copy_(torch.tensor([7, 8, 9]))  # the load fills the tensor after decoding the value
    assert arr.tolist() == [7, 8, 9]


def test_object_and_structured_arrays_are_refused_without_pickle():
    with pytest.raises(UnsupportedStateError, match="allow_pickle"):
        encode_value(np.array([{"a": 1}], dtype=object), "x", {}.__setitem__)
    with pytest.raises(UnsupportedStateError, match="allow_pickle"):
        encode_value(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]), "x", {}.__setitem__)


@pytest.mark.parametrize("doc,match", [
    ({"__sp__": "ndarray", "dtype": "O", "shape": [1], "b64": ""}, "not a fixed-size numpy dtype"),
    ({"__sp__": "ndarray", "dtype": "<f4", "shape": [2], "b64": "AAAA"}, "holds 3 bytes"),
    ({"__sp__": "ndarray", "dtype": "<f4", "shape": [-1], "b64": ""}, "shape"),
    ({"__sp__": "ndarray", "dtype": "<f4", "key": "x"}, "stored as a int64 tensor"),
])
def test_malformed_ndarray_values_raise_format_error(doc, match):
    with pytest.raises(FormatError, match=match):
        decode_value(doc, {"x": torch.zeros(2, dtype=torch.int64)}.__getitem__, where="ckpt")


def test_tensors_become_references():
    t1, t2 = torch.arange(3.0), torch.ones(2, 2, dtype=torch.bfloat16)
    value = {"w": t1, "nested": [t2, (t1,)]}
    seen = {}
    doc = encode_value(value, "extra", seen.__setitem__)
    assert doc["w"] == {"__sp__": "tensor", "key": "extra.w"}
    assert list(seen) == ["extra.w", "extra.nested.0", "extra.nested.1.0"]
    assert seen["extra.nested.0"] is t2
    got = decode_value(doc, lambda k: f"<{k}>")
    assert got == {"w": "<extra.w>", "nested": ["<extra.nested.0>", ("<extra.nested.1.0>",)]}


class Opaque:
    pass


@pytest.mark.parametrize("value", [Opaque(), {"deep": [Opaque()]}, {Opaque(): 1}, set([1])], ids=["obj", "nested", "key", "set"])
def test_unknown_objects_refused(value):
    with pytest.raises(UnsupportedStateError, match=r"root|allow_pickle"):
        encode_value(value, "root", lambda *_: None)


def test_unknown_object_message_names_path_and_remedy():
    with pytest.raises(UnsupportedStateError, match=r"cannot encode Opaque at 'root\.deep\.0' safely.*allow_pickle=True"):
        encode_value({"deep": [Opaque()]}, "root", lambda *_: None)
    with pytest.raises(UnsupportedStateError, match=r"dict key .* at 'root' is not a str/int/float/bool/tuple"):
        encode_value({Opaque(): 1}, "root", lambda *_: None)


def test_pickle_opt_in():
    value = {"frac": Fraction(1, 3), "s": {1, 2}}
    back, _, doc = round_trip(value, allow_pickle=True)
    assert back == value
    assert doc["frac"]["__sp__"] == "pickle"
    with pytest.raises(FormatError, match=r"ckpt: holds a pickled value; pass allow_pickle=True only if you trust"):
        decode_value(doc, lambda k: None, allow_pickle=False, where="ckpt")


def test_encode_depth_limit():
    deep = 0
    for _ in range(70):
        deep = [deep]
    with pytest.raises(UnsupportedStateError, match="nests deeper than 64 levels"):
        encode_value(deep, "root", lambda *_: None)
    ok = 0
    for _ in range(60):
        ok = [ok]
    assert round_trip(ok)[0] == ok


def test_decode_depth_limit():
    deep = 0
    for _ in range(70):
        deep = {"k": deep}
    with pytest.raises(FormatError, match="ckpt: value nests deeper than 64 levels"):
        decode_value(deep, lambda k: None, where="ckpt")


@pytest.mark.parametrize(
    "doc,pattern",
    [
        ({"__sp__": "nope"}, r"unknown value tag 'nope'"),
        ({"__sp__": "float", "v": "1e999"}, r"bad float tag '1e999'"),
        ({"__sp__": "float"}, r"malformed 'float' value: field 'v'"),
        ({"__sp__": "tuple"}, r"malformed 'tuple' value: field 'v' must be a list"),
        ({"__sp__": "tuple", "v": 3}, r"malformed 'tuple' value"),
        ({"__sp__": "dict", "items": [[1]]}, r"malformed dict item"),
        ({"__sp__": "dict", "items": 5}, r"malformed 'dict' value: field 'items'"),
        ({"__sp__": "dict", "items": [[[1], 2]]}, r"unhashable dict key"),
        ({"__sp__": "bytes", "b64": "!!!"}, r"malformed base64"),
        ({"__sp__": "bytes", "b64": 5}, r"malformed 'bytes' value"),
        ({"__sp__": "tensor"}, r"malformed 'tensor' value: field 'key'"),
        ({"__sp__": "tensor", "key": 5}, r"malformed 'tensor' value"),
        ({"__sp__": "dtype", "v": "nn"}, r"unknown dtype 'nn'"),
        ({"__sp__": "dtype", "v": "__class__"}, r"unknown dtype"),
        ({"__sp__": "dtype"}, r"malformed 'dtype' value"),
        ({"__sp__": "pickle", "b64": "!!"}, r"holds a pickled value"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_malformed_documents_are_format_errors(doc, pattern):
    with pytest.raises(FormatError, match=pattern):
        decode_value({"x": [doc]}, lambda k: None, where="ckpt")


def test_malformed_pickle_payload_with_pickle_allowed():
    with pytest.raises(FormatError, match="malformed base64"):
        decode_value({"__sp__": "pickle", "b64": "!!"}, lambda k: None, allow_pickle=True)


# --- property ------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
    st.binary(max_size=8), st.sampled_from([torch.float32, torch.int8, torch.bfloat16]),
)
keys = st.one_of(st.text(max_size=6), st.integers(), st.just("__sp__"))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_round_trip_property(value):
    back, _, _ = round_trip(value)
    assert same(back, value)
