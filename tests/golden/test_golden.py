"""Every committed golden checkpoint still loads, bit-exactly, and reads without shardpoint.

``vN/`` was written by ``make_golden.py`` and is never regenerated casually:
it stands for every version-N checkpoint already on someone's disk. ``v2/``
was saved by 2 ranks; everything here reads it in one process, with no
process group (a 2 -> 1 reshard).
"""

from __future__ import annotations

import functools
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

from .make_golden import V2_HOLDERS, build_model, build_model_v2, special_value, write, write_v2

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VERSIONS = [1, 2, 3]
MODELS = {1: build_model, 2: build_model_v2, 3: build_model_v2}


def folder(version: int) -> Path:
    return HERE / f"v{version}"


@functools.lru_cache(maxsize=None)
def _expected(version: int):
    tensors = load_file(str(HERE / f"v{version}_expected.safetensors"))
    with open(HERE / f"v{version}_expected.json", encoding="utf-8") as f:
        doc = json.load(f)
    return tensors, doc


@pytest.fixture(params=VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def version(request) -> int:
    return request.param


@pytest.fixture
def expected(version):
    tensors, doc = _expected(version)
    return {k: v.clone() for k, v in tensors.items()}, doc


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def test_committed_checkpoint_is_small_and_of_its_version(version, expected):
    _, doc = expected
    ckpt = folder(version)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    files += [HERE / f"v{version}_expected.safetensors", HERE / f"v{version}_expected.json"]
    assert sum(p.stat().st_size for p in files) < 100_000
    m = sp.read_manifest(str(ckpt))
    assert m.format_version == version == doc["format_version"]
    listed = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert listed == sorted([*m.files, "manifest.json"])
    for name, size in m.files.items():
        assert (ckpt / name).stat().st_size == size, name
    if version == 1:
        return
    raw_bytes = (ckpt / "manifest.json").read_bytes()
    if version >= 3:  # the manifest ends with the digest of everything before its digest member
        import xxhash

        head, _, tail = raw_bytes.rpartition(b',"digest":"')
        assert tail.endswith(b'"}') and xxhash.xxh3_128_hexdigest(head) == tail[:-2].decode()
        for r in m.ranks:  # and each index ends with its own digest, with keys bound to the dtype
            idx = (ckpt / r.index).read_bytes()
            assert idx[:8] == b"SPIDX\x00\x03\x00" and xxhash.xxh3_128_digest(idx[:-16]) == idx[-16:]
    # Versions 2 and 3: chunk records live in the ranks' index files, not in the manifest.
    raw = json.loads(raw_bytes)
    assert raw["world_size"] == 2 and all("chunks" not in t for t in raw["tensors"].values())
    bare = sp.read_manifest(str(ckpt), chunks=False)
    assert all(t.chunks is None for t in bare.tensors.values())
    assert len(m.ranks) == 2 and all(r is not None for r in m.ranks)
    assert sorted(f for r in m.ranks for f in (r.data, r.index)) == sorted(m.files)
    assert sum(f.endswith(".idx") for f in m.files) == 2
    grids = {k for k, t in bare.tensors.items() if t.grid is not None}
    holders = {k for k, t in bare.tensors.items() if t.holders is not None}
    assert grids and holders == set(V2_HOLDERS) == set(doc["holders"])
    assert grids | holders == set(bare.tensors) and not grids & holders
    w = bare.tensors["model.0.weight"].grid  # FSDP2 Shard(0): 5 rows over 2 ranks
    assert w.mesh_shape == (2,) and w.ranks == (0, 1) and w.splits == ((0,), ())


def test_manifest_lists_expected_tensors(version, expected):
    tensors, doc = expected
    m = sp.read_manifest(str(folder(version)))  # v2: resolves every chunk from the index files
    assert sorted(m.tensors) == doc["tensor_names"] == sorted(tensors)
    for name, meta in m.tensors.items():
        t = tensors[name]
        assert meta.dtype == str(t.dtype).removeprefix("torch.") and meta.shape == tuple(t.shape), name
        covered = sum(c.box.numel if c.flat is None else c.flat[1] - c.flat[0] for c in meta.chunks)
        assert covered == t.numel(), name
    if version >= 2:  # the uneven split and the empty shard of the 1-row layer
        assert sorted(c.box.sizes for c in m.tensors["model.0.weight"].chunks) == [(2, 4), (3, 4)]
        assert [c.box.sizes for c in m.tensors["model.3.weight"].chunks if c.box.numel] == [(1, 3)]


def test_loads_bit_exactly(version, expected):
    tensors, doc = expected
    torch.manual_seed(999)  # different init: everything must come from the checkpoint
    model = MODELS[version]()
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    state = {"model": model, "optim": opt, "extra": None}
    sp.load(str(folder(version)), state)

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
    extra_tensors = [k.removeprefix("extra.") for k in tensors if k.startswith("extra.")]
    for k in extra_tensors:
        assert type(extra[k]) is torch.Tensor and bits_equal(extra[k], tensors[f"extra.{k}"]), k
    assert extra["scalar"].dim() == 0 and extra["bf16"].dtype == torch.bfloat16
    assert sorted(extra) == sorted([*doc["plain"], *doc["special"], *extra_tensors])


def test_read_tensor_whole_and_box(version, expected):
    tensors, _ = expected
    path = str(folder(version))
    for name in ["model.0.weight", "model.1.num_batches_tracked", "extra.bf16", *(V2_HOLDERS if version >= 2 else ())]:
        assert bits_equal(sp.read_tensor(path, name), tensors[name]), name
    # Rows 1-3 cross the v2 shard boundary (rows 0-2 on rank 0, 3-4 on rank 1).
    box = (slice(1, 4), slice(1, 3))
    assert bits_equal(sp.read_tensor(path, "model.0.weight", box), tensors["model.0.weight"][box])
    assert bits_equal(sp.read_tensor(path, "extra.bf16", (slice(2, 3),)), tensors["extra.bf16"][2:3])


# A stand-alone reader: json + numpy (+ xxhash for checksums). It runs in a fresh
# interpreter where importing shardpoint or torch fails, to prove it needs neither.
# Version 2 follows docs/format.md (its appendix lists what differs from version 3): grid arithmetic, index files.
READER = textwrap.dedent(
    """
    import itertools, json, os, sys
    sys.modules["shardpoint"] = None
    sys.modules["torch"] = None
    import numpy as np
    import xxhash

    NP = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8",
          "int32": "<i4", "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}
    ROW = np.dtype([("key", "<u8"), ("offset", "<u8"), ("nbytes", "<u8"), ("flat_start", "<u8"),
                    ("flat_stop", "<u8"), ("nsum", "<u8"), ("ndim", "<u4"), ("flags", "<u4")])

    def safe(folder, name):
        assert not name.startswith("/") and ".." not in name.split("/")
        return os.path.join(folder, name)

    def index_rows(folder, m, rank):
        data, index, digest = m["ranks"][rank]
        with open(safe(folder, index), "rb") as f:
            raw = f.read()
        assert len(raw) == m["files"][index] and xxhash.xxh3_128_hexdigest(raw) == digest
        v3 = m["format_version"] >= 3  # version 3 ends with a 16-byte digest of what precedes it
        assert raw[:8] == (b"SPIDX\\x00\\x03\\x00" if v3 else b"SPIDX\\x00\\x02\\x00")
        n, nd, ns = (int(v) for v in np.frombuffer(raw, "<u8", 3, 8))
        assert len(raw) == 32 + 56 * n + 8 * nd + 8 * ns + (16 if v3 else 0)
        assert not v3 or xxhash.xxh3_128_digest(raw[:-16]) == raw[-16:]
        dims = np.frombuffer(raw, "<u8", nd, 32 + 56 * n)
        sums = np.frombuffer(raw, "<u8", ns, 32 + 56 * n + 8 * nd)
        d = s = 0
        for row in np.frombuffer(raw, ROW, n, 32):
            k, c = int(row["ndim"]), {"file": data, "offset": int(row["offset"]), "nbytes": int(row["nbytes"])}
            box = [int(v) for v in dims[d:d + 2 * k]]
            c["offsets"], c["sizes"] = box[:k], box[k:]
            c["checksums"] = ["%016x" % int(v) for v in sums[s:s + int(row["nsum"])]]
            if int(row["flags"]) & 1:
                c["flat"] = [int(row["flat_start"]), int(row["flat_stop"])]
            d, s = d + 2 * k, s + int(row["nsum"])
            yield int(row["key"]), c

    def grid_shards(m, t):
        # (writer rank, offsets, sizes) of every non-empty shard, by section 14.3.
        g = t["grid"]
        mesh = m["meshes"][g["mesh"]]
        mshape, split = mesh["shape"], {x for s in g["splits"] for x in s}
        rep, c = {}, g["copy"]
        for x in reversed([x for x in range(len(mshape)) if x not in split]):
            rep[x], c = c % mshape[x], c // mshape[x]
        for coord in itertools.product(*[range(k) if x in split else [rep[x]] for x, k in enumerate(mshape)]):
            offs, sizes = [], []
            for n, s in zip(t["shape"], g["splits"]):
                lo = 0
                for x in s:
                    q = -(-n // mshape[x])
                    a, b = min(coord[x] * q, n), min((coord[x] + 1) * q, n)
                    lo, n = lo + a, b - a
                offs.append(lo)
                sizes.append(n)
            if all(sizes):
                flat = 0
                for x, k in enumerate(mshape):
                    flat = flat * k + coord[x]
                yield mesh["ranks"][flat], offs, sizes

    def chunks(folder, m, name):
        t = m["tensors"][name]
        if m["format_version"] == 1:
            return t["chunks"]
        raw_key = name.encode("utf-8") + (b"\\0" + t["dtype"].encode() if m["format_version"] >= 3 else b"")
        key = xxhash.xxh3_64_intdigest(raw_key)
        if "holders" in t:
            return [c for a, b in t["holders"] for r in range(a, b) for k, c in index_rows(folder, m, r) if k == key]
        out = []
        for rank, offs, sizes in grid_shards(m, t):
            found = [c for k, c in index_rows(folder, m, rank) if k == key and c["offsets"] == offs and c["sizes"] == sizes]
            assert len(found) == 1 and "flat" not in found[0], (name, rank)
            out += found
        return out

    def read(folder, name):
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            m = json.load(f)
        assert m["format"] == "shardpoint" and m["format_version"] in (1, 2, 3)
        t = m["tensors"][name]
        out = np.zeros(t["shape"], dtype=NP[t["dtype"]])
        seen = 0
        for c in chunks(folder, m, name):
            with open(safe(folder, c["file"]), "rb") as f:
                f.seek(c["offset"])
                raw = f.read(c["nbytes"])
            b = m["block_size"]
            sums = [xxhash.xxh3_64_hexdigest(raw[i:i + b]) for i in range(0, max(len(raw), 1), b)]
            assert sums == c["checksums"], name
            data = np.frombuffer(raw, dtype=out.dtype)
            seen += data.size
            box = out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"])) + (...,)]
            if "flat" in c:
                whole = box.copy().reshape(-1)
                whole[c["flat"][0]:c["flat"][1]] = data
                box[...] = whole.reshape(box.shape)
            else:
                box[...] = data.reshape(c["sizes"])
        assert seen == out.size, name
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
# v2 adds: a holders tensor, a shard-less rank (1 row over 2), a scalar written by copy 1.
NUMPY_NAMES_V2 = [*V2_HOLDERS, "model.3.weight", "optim.state.model.0.weight.step", "model.1.running_var"]


def _numpy_names(version: int) -> list[str]:
    return NUMPY_NAMES + (NUMPY_NAMES_V2 if version >= 2 else [])


def _check_npz(dest: Path, tensors: dict, names: list[str]) -> None:
    import numpy as np

    got = np.load(dest)
    for name in names:
        arr = got[name.replace(".", "__")]
        want = tensors[name]
        if want.dtype == torch.bfloat16:
            want = want.float()  # bf16 -> f32 is exact
        want = want.numpy()
        assert arr.shape == want.shape and arr.dtype == want.dtype, name
        assert arr.tobytes() == want.tobytes(), name


def _run_isolated(text: str, args: list[str], version, tensors, tmp_path) -> None:
    """Run ``text`` in a fresh interpreter with ``args``, the folder, an output file and the names; check its output."""
    script = tmp_path / "runner.py"
    script.write_text(text)
    dest = tmp_path / "out.npz"
    names = _numpy_names(version)
    proc = subprocess.run(
        [sys.executable, "-I", str(script), *args, str(folder(version)), str(dest), *names],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    _check_npz(dest, tensors, names)


def test_readable_with_numpy_only(version, expected, tmp_path):
    _run_isolated(READER, [], version, expected[0], tmp_path)


# The shipped example, run the same way (no shardpoint, no torch).
EXAMPLE = textwrap.dedent(
    """
    import runpy, sys
    sys.modules["shardpoint"] = None
    sys.modules["torch"] = None
    import numpy as np
    example, folder, dest = sys.argv[1:4]
    read_tensor = runpy.run_path(example)["read_tensor"]
    np.savez(dest, **{n.replace(".", "__"): read_tensor(folder, n, verify=True) for n in sys.argv[4:]})
    """
)


def test_example_reader_reads_it(version, expected, tmp_path):
    _run_isolated(EXAMPLE, [str(ROOT / "examples" / "read_with_numpy.py")], version, expected[0], tmp_path)


@pytest.mark.parametrize("script", [READER, EXAMPLE], ids=["reader", "example"])
def test_reader_script_really_cannot_import_shardpoint(script, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(script.split("import numpy")[0] + "import shardpoint\n")
    proc = subprocess.run([sys.executable, "-I", str(probe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def _layout_of(t) -> tuple:
    """How a tensor is found: its grid's mesh and splits, or just "holders" (writer choice may vary)."""
    if t.grid is not None:
        return ("grid", t.grid.mesh_shape, t.grid.ranks, t.grid.splits)
    return ("holders",) if t.holders is not None else ("chunks",)


def test_todays_writer_produces_the_same_tensor_table(version, tmp_path):
    """A save by the current code names, types, shapes and places everything as the committed one.

    For v2 and v3 this launches 2 gloo ranks (the only tests here that do).
    """
    ckpt = write(tmp_path) if version == 1 else write_v2(tmp_path, f"v{version}", version)
    now, then = sp.read_manifest(str(ckpt), chunks=False), sp.read_manifest(str(folder(version)), chunks=False)
    assert {k: (t.dtype, t.shape) for k, t in now.tensors.items()} == {
        k: (t.dtype, t.shape) for k, t in then.tensors.items()
    }
    assert now.values["extra"] == then.values["extra"]
    assert now.format_version == sp.FORMAT_VERSION == 3
    if version >= 2:
        assert {k: _layout_of(t) for k, t in now.tensors.items()} == {k: _layout_of(t) for k, t in then.tensors.items()}
