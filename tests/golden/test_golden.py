"""The committed format-version-1 checkpoint still loads, bit-exactly, and reads without shardpoint.

``v1/`` was written by ``make_golden.py`` and is never regenerated casually:
it stands for every version-1 checkpoint already on someone's disk.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardpoint as sp

from .make_golden import build_model, special_value, write

HERE = Path(__file__).resolve().parent
V1 = HERE / "v1"


@pytest.fixture(scope="module")
def expected():
    tensors = load_file(str(HERE / "v1_expected.safetensors"))
    with open(HERE / "v1_expected.json", encoding="utf-8") as f:
        doc = json.load(f)
    return tensors, doc


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def test_committed_checkpoint_is_small_and_v1():
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 100_000
    m = sp.read_manifest(str(V1))
    assert m.format_version == 1
    assert sorted(p.relative_to(V1).as_posix() for p in V1.rglob("*") if p.is_file()) == sorted(
        [*m.files, "manifest.json"]
    )


def test_manifest_lists_expected_tensors(expected):
    tensors, doc = expected
    m = sp.read_manifest(str(V1))
    assert sorted(m.tensors) == doc["tensor_names"] == sorted(tensors)
    for name, meta in m.tensors.items():
        t = tensors[name]
        assert meta.dtype == str(t.dtype).removeprefix("torch.") and meta.shape == tuple(t.shape), name


def test_loads_bit_exactly(expected):
    tensors, doc = expected
    torch.manual_seed(999)  # different init: everything must come from the checkpoint
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    state = {"model": model, "optim": opt, "extra": None}
    sp.load(str(V1), state)

    for k, v in model.state_dict().items():
        assert bits_equal(v, tensors[f"model.{k}"]), k

    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    seen = set()
    for p, s in opt.state.items():
        for k, v in s.items():
            key = f"optim.state.{names[id(p)]}.{k}"
            assert bits_equal(v, tensors[key]), key
            seen.add(key)
    assert seen == {k for k in tensors if k.startswith("optim.")}
    for g, want in zip(opt.param_groups, doc["optim_groups"], strict=True):
        for k, v in want.items():
            got = list(g[k]) if isinstance(g[k], tuple) else g[k]
            assert got == v, k
        assert isinstance(g["betas"], tuple)

    extra = state["extra"]
    for k, v in doc["plain"].items():
        assert extra[k] == v, k
    for k, (kind, data) in doc["special"].items():
        want = special_value(kind, data)
        got = extra[k]
        assert type(got) is type(want), k
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == want, k
    for k in ["bf16", "scalar", "int_scalar", "mask"]:
        assert bits_equal(extra[k], tensors[f"extra.{k}"]), k
    assert extra["scalar"].dim() == 0 and extra["bf16"].dtype == torch.bfloat16
    assert sorted(extra) == sorted([*doc["plain"], *doc["special"], "bf16", "scalar", "int_scalar", "mask"])


# A stand-alone reader: json + numpy (+ xxhash for checksums). It runs in a fresh
# interpreter where importing shardpoint or torch fails, to prove it needs neither.
READER = textwrap.dedent(
    """
    import json, os, sys
    sys.modules["shardpoint"] = None
    sys.modules["torch"] = None
    import numpy as np
    import xxhash

    NP = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8",
          "int32": "<i4", "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}

    def read(folder, name):
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            m = json.load(f)
        assert m["format"] == "shardpoint" and m["format_version"] == 1
        t = m["tensors"][name]
        out = np.zeros(t["shape"], dtype=NP[t["dtype"]])
        for c in t["chunks"]:
            assert not c["file"].startswith("/") and ".." not in c["file"].split("/")
            with open(os.path.join(folder, c["file"]), "rb") as f:
                f.seek(c["offset"])
                raw = f.read(c["nbytes"])
            b = m["block_size"]
            sums = [xxhash.xxh3_64_hexdigest(raw[i:i + b]) for i in range(0, max(len(raw), 1), b)]
            assert sums == c["checksums"], name
            data = np.frombuffer(raw, dtype=out.dtype)
            box = out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"])) + (...,)]
            if "flat" in c:
                whole = box.copy().reshape(-1)
                whole[c["flat"][0]:c["flat"][1]] = data
                box[...] = whole.reshape(box.shape)
            else:
                box[...] = data.reshape(c["sizes"])
        if t["dtype"] == "bfloat16":
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out

    folder, dest = sys.argv[1], sys.argv[2]
    names = sys.argv[3:]
    np.savez(dest, **{n.replace(".", "__"): read(folder, n) for n in names})
    """
)

NUMPY_NAMES = ["model.0.weight", "model.1.num_batches_tracked", "optim.state.model.2.weight.exp_avg_sq",
               "extra.bf16", "extra.scalar", "extra.mask"]


def test_readable_with_numpy_only(expected, tmp_path):
    import numpy as np

    tensors, _ = expected
    script = tmp_path / "reader.py"
    script.write_text(READER)
    dest = tmp_path / "out.npz"
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(V1), str(dest), *NUMPY_NAMES],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    got = np.load(dest)
    for name in NUMPY_NAMES:
        arr = got[name.replace(".", "__")]
        want = tensors[name]
        if want.dtype == torch.bfloat16:
            want = want.float()  # bf16 -> f32 is exact
        want = want.numpy()
        assert arr.shape == want.shape and arr.dtype == want.dtype, name
        assert arr.tobytes() == want.tobytes(), name


def test_reader_script_really_cannot_import_shardpoint(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(READER.split("import numpy")[0] + "import shardpoint\n")
    proc = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_todays_writer_produces_the_same_tensor_table(tmp_path):
    """A save by the current code names, types and shapes everything as the committed one."""
    ckpt = write(tmp_path)
    now, then = sp.read_manifest(str(ckpt)), sp.read_manifest(str(V1))
    assert {k: (t.dtype, t.shape) for k, t in now.tensors.items()} == {
        k: (t.dtype, t.shape) for k, t in then.tensors.items()
    }
    assert now.values["extra"] == then.values["extra"]
