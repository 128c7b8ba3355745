"""``shardpoint.save``/``load`` in one process with no process group."""

from __future__ import annotations

import contextlib
import os
import re
from fractions import Fraction

import pytest
import torch

import shardpoint as sp
from shardpoint.storage import LocalStorage, MemoryStorage, Storage, Writer
from shardpoint.testing import flip_byte

from .conftest import build_model, train


# --- helpers -----------------------------------------------------------------


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    # bit-exact: compare raw bytes so that nan payloads and -0.0 count too
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), what


def assert_same_module(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_same_tensor(sa[k], sb[k], k)


def assert_same_tree(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b, path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=repr) == sorted(b, key=repr), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}.{i}")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"], "the reference optimizer has state"
    assert_same_tree(sa, sb, "optim")


def tensor_values() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "step": 2,
        "name": "run-α",
        "lrs": [0.1, 0.05, float("inf")],
        "betas": (0.9, 0.99),
        "by_epoch": {1: "a", 2: "b"},
        "blob": b"\x00\x01",
        "dtype": torch.bfloat16,
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(2, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "int_scalar": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
        "strided": torch.arange(12.0).view(3, 4).t(),  # non-contiguous
        "nan": torch.tensor([float("nan"), -0.0, float("-inf")]),
    }


def data_files(storage: Storage) -> list[str]:
    return storage.list("data/")


# --- round trips ------------------------------------------------------------------


@pytest.fixture(params=["str", "pathlike", "memory"])
def location(request, tmp_path):
    if request.param == "str":
        return str(tmp_path / "ckpt")
    if request.param == "pathlike":
        return tmp_path / "ckpt"
    return MemoryStorage()


def test_model_and_optimizer_round_trip(location, trained, fresh):
    m, opt = trained()
    res = sp.save(location, {"model": m, "optim": opt, "extra": {"step": 2}})
    manifest = sp.read_manifest(location)
    assert res.save_id == manifest.save_id
    assert res.bytes_written == sum(manifest.files.values()) > 0
    m2, opt2 = fresh()
    assert not opt2.state
    state = {"model": m2, "optim": opt2, "extra": None}
    report = sp.load(location, state, return_result=True)
    out = report.state
    assert out is state and state["model"] is m2 and state["optim"] is opt2
    assert state["extra"] == {"step": 2}
    assert_same_module(m, m2)
    assert_same_optimizer(opt, opt2)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["betas"] == (0.8, 0.95)
    assert report.missing == [] and report.unexpected == []
    assert report.bytes_read >= report.bytes_needed > 0
    # training continues identically
    train(m, opt, 1, seed=5)
    train(m2, opt2, 1, seed=5)
    assert_same_module(m, m2)
    assert_same_optimizer(opt, opt2)


def test_plain_values_and_tensors_replaced(location):
    saved = tensor_values()
    sp.save(location, {"extra": saved, "rng": torch.get_rng_state(), "count": 5})
    state = {"extra": {"step": 0, "f64": torch.zeros(1)}, "rng": None, "count": 0}
    sp.load(location, state)
    assert state["count"] == 5
    assert_same_tensor(torch.get_rng_state(), state["rng"], "rng")
    got = state["extra"]
    assert sorted(got) == sorted(saved)
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert_same_tensor(v.contiguous(), got[k], k)
        elif k == "lrs":
            assert got[k] == v and got[k][2] == float("inf")
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def test_loaded_tensors_are_independent_of_saved(location):
    t = torch.arange(4.0)
    sp.save(location, {"t": t})
    state = {"t": None}
    sp.load(location, state)
    t.add_(1)
    assert state["t"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_small_blocks_round_trip_and_reuse(tmp_path, trained, fresh):
    # many checksum blocks per chunk, and loading the same checkpoint twice
    m, opt = trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optim": opt}, block_size=32)
    assert sp.read_manifest(path).block_size == 32
    m2, opt2 = fresh()
    sp.load(path, {"model": m2, "optim": opt2})
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    sp.load(path, {"model": m2, "optim": opt2})
    assert_same_module(m, m2)
    assert_same_optimizer(opt, opt2)


def test_bad_block_size(tmp_path):
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 16, got 40"):
        sp.save(str(tmp_path / "x"), {"a": 1}, block_size=40)


def test_bad_state_keys(tmp_path):
    with pytest.raises(sp.UnsupportedStateError, match=r"state keys must be non-empty strings without '\.', got 'a\.b'"):
        sp.save(str(tmp_path / "x"), {"a.b": 1})
    with pytest.raises(sp.UnsupportedStateError, match="state must be a dict"):
        sp.save(str(tmp_path / "x"), [1])


# --- errors -------------------------------------------------------------------------


def test_missing_path(tmp_path):
    where = str(tmp_path / "nope")
    with pytest.raises(sp.CheckpointNotFoundError, match=rf"no checkpoint at {re.escape(where)}: the path does not exist"):
        sp.load(where, {"a": None})
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.read_manifest(where)
    with pytest.raises(sp.CheckpointNotFoundError, match="memory://"):
        sp.load(MemoryStorage(), {"a": None})


def test_folder_without_manifest(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"t": torch.ones(3)})
    os.unlink(os.path.join(path, "manifest.json"))
    assert os.listdir(os.path.join(path, "data"))  # data is there
    with pytest.raises(sp.IncompleteCheckpointError, match=rf"{re.escape(path)} holds no committed manifest.*interrupted"):
        sp.load(path, {"t": None})


def _chunk_of(path, fqn):
    m = sp.read_manifest(path)
    (chunk,) = m.tensors[fqn].chunks
    return chunk


def _flip(path, file, pos):
    flip_byte(os.path.join(path, file), pos)


@pytest.mark.parametrize("block_size", [4 << 20, 32])
def test_flipped_byte_is_corrupt(tmp_path, trained, fresh, block_size):
    m, opt = trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optim": opt}, block_size=block_size)
    chunk = _chunk_of(path, "model.2.weight")
    _flip(path, chunk.file, chunk.offset + 37)
    m2, opt2 = fresh()
    block_lo = 0 if block_size > chunk.nbytes else 32
    pattern = (
        rf"checksum mismatch in {re.escape(chunk.file)} bytes \[{chunk.offset + block_lo}, \d+\) "
        rf"of tensor 'model\.2\.weight'"
    )
    with pytest.raises(sp.CorruptCheckpointError, match=pattern):
        sp.load(path, {"model": m2, "optim": opt2})
    # verify=False trusts the bytes: it loads, and the flipped value shows
    m3, opt3 = fresh()
    sp.load(path, {"model": m3, "optim": opt3}, verify=False)
    assert not torch.equal(m3[2].weight, m[2].weight)
    assert torch.equal(m3[0].weight, m[0].weight)


def test_missing_data_file_is_corrupt(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"t": torch.ones(3)})
    chunk = _chunk_of(path, "t")
    os.unlink(os.path.join(path, chunk.file))
    with pytest.raises(sp.CorruptCheckpointError, match=rf"data file {re.escape(chunk.file)} of tensor 't' is missing"):
        sp.load(path, {"t": None})


def _truncate_last_tensor(path):
    m = sp.read_manifest(path)
    (file, size), = [(f, n) for f, n in m.files.items() if f.endswith(".bin")]
    with open(os.path.join(path, file), "r+b") as f:
        f.truncate(size - 5)
    return file


def test_truncated_data_file_is_corrupt(tmp_path, trained, fresh):
    m, opt = trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optim": opt, "extra": {"last": torch.arange(5.0)}})
    file = _truncate_last_tensor(path)
    m2, opt2 = fresh()
    # the last tensor written is the one cut short
    with pytest.raises(
        sp.CorruptCheckpointError,
        match=rf"data file {re.escape(file)} of tensor 'extra\.last' is shorter than the manifest says",
    ):
        sp.load(path, {"model": m2, "optim": opt2, "extra": None})


def test_param_without_optimizer_state(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    opt = torch.optim.AdamW(m.parameters())
    m["used"](torch.randn(3, 2)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optim": opt})
    m2 = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    opt2 = torch.optim.AdamW(m2.parameters())
    sp.load(path, {"model": m2, "optim": opt2})
    assert_same_module(m, m2)
    assert_same_optimizer(opt, opt2)


def test_strict_key_mismatch(tmp_path, trained, fresh):
    m, opt = trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "extra": {"step": 3}, "gone": 1})
    m2, _ = fresh(extra_layer=True)
    state = {"model": m2, "extra": None, "new": 0}
    with pytest.raises(sp.KeyMismatchError) as ei:
        sp.load(path, state)
    e = ei.value
    assert sorted(e.missing) == ["model.3.bias", "model.3.weight", "new"]
    assert sorted(e.unexpected) == ["gone"]
    msg = str(e)
    assert "missing from the checkpoint ['model.3.bias', 'model.3.weight', 'new']" in msg
    assert "unexpected in the checkpoint ['gone']" in msg and "strict=False" in msg
    assert state["extra"] is None  # nothing was installed

    report = sp.load(path, state, strict=False, return_result=True)
    assert report.missing == ["model.3.bias", "model.3.weight", "new"]
    assert report.unexpected == ["gone"]
    assert state["extra"] == {"step": 3} and state["new"] == 0
    for k in ["0.weight", "0.bias", "1.running_mean", "2.weight"]:
        assert_same_tensor(m.state_dict()[k], m2.state_dict()[k], k)


def test_unexpected_module_tensor(tmp_path, fresh):
    big, _ = fresh(extra_layer=True)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": big})
    small, _ = fresh(seed=3)
    with pytest.raises(sp.KeyMismatchError) as ei:
        sp.load(path, {"model": small})
    assert sorted(ei.value.unexpected) == ["model.3.bias", "model.3.weight"] and ei.value.missing == []


def test_shape_mismatch(tmp_path, trained):
    m, _ = trained()
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m})
    wide = build_model(0, hidden=9)
    with pytest.raises(
        sp.ShapeMismatchError,
        match=r"tensor 'model\.0\.weight': checkpoint has float32\[8, 4\], target has float32\[9, 4\]",
    ):
        sp.load(path, {"model": wide})
    with pytest.raises(sp.ShapeMismatchError, match=r"checkpoint has float32\[8, 4\], target has float64\[8, 4\]"):
        sp.load(path, {"model": build_model(0).double()})


def test_unsafe_value_refused(tmp_path):
    path = str(tmp_path / "ck")

    class Thing:
        pass

    with pytest.raises(sp.UnsupportedStateError, match=r"cannot encode \S*Thing at 'extra\.cfg\.1' safely.*allow_pickle=True"):
        sp.save(path, {"extra": {"cfg": [1, Thing()]}})
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(path, {"extra": None})


def test_pickle_is_opt_in_both_ways(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"f": Fraction(2, 3)}}, allow_pickle=True)
    with pytest.raises(sp.FormatError, match="holds a pickled value; pass allow_pickle=True"):
        sp.load(path, {"extra": None})
    state = {"extra": None}
    sp.load(path, state, allow_pickle=True)
    assert state["extra"] == {"f": Fraction(2, 3)}


def test_tampered_manifest_is_format_error(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"t": torch.ones(2)})
    mpath = os.path.join(path, "manifest.json")
    with open(mpath, "rb") as f:
        text = f.read()
    edited = text.replace(b'"format_version":3', b'"format_version":99')
    with open(mpath, "wb") as f:
        f.write(edited)
    # An edit that does not re-seal the manifest breaks its digest, checked before parsing.
    with pytest.raises(sp.CorruptCheckpointError, match=r"manifest.json does not match its own digest"):
        sp.load(path, {"t": None})
    # A re-sealed one (a genuinely newer format) is refused by version.
    from shardpoint.format.manifest import seal

    with open(mpath, "wb") as f:
        f.write(seal(edited[: edited.rindex(b',"digest":')] + b"}"))
    with pytest.raises(sp.FormatError, match=r"format_version 99 is not supported"):
        sp.load(path, {"t": None})


# --- crash safety -------------------------------------------------------------------------


class InjectedFailure(OSError):
    pass


class _Budget:
    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self, n: int) -> int:
        """How many of ``n`` bytes may still be written."""
        ok = max(0, min(n, self.limit - self.used))
        self.used += ok
        return ok


class _FailingWriter(Writer):
    def __init__(self, inner: Writer, budget: _Budget):
        self._inner, self._budget = inner, budget

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        ok = self._budget.take(len(mv))
        if ok:
            self._inner.write(mv[:ok])
        if ok < len(mv):
            raise InjectedFailure(f"injected failure after {self._budget.limit} bytes")

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class FailingStorage(Storage):
    """Wraps a storage; every write (data or manifest) fails once ``limit`` bytes went through."""

    def __init__(self, inner: Storage, limit: int, _budget: _Budget | None = None):
        super().__init__()
        self.inner = inner
        self.budget = _budget or _Budget(limit)
        self.url = inner.url
        self.stats = inner.stats

    def open_writer(self, name):
        return _FailingWriter(self.inner.open_writer(name), self.budget)

    def put_atomic(self, name, data):
        if self.budget.take(len(data)) < len(data):
            raise InjectedFailure(f"injected failure writing {name}")
        self.inner.put_atomic(name, data)

    # Claims and listings pass through: the budget counts checkpoint bytes only.
    def create_exclusive(self, name, data):
        return self.inner.create_exclusive(name, data)

    def replace_if(self, name, expected, data):
        return self.inner.replace_if(name, expected, data)

    def modified_times(self, prefix=""):
        return self.inner.modified_times(prefix)

    def readinto(self, name, offset, buf):
        self.inner.readinto(name, offset, buf)

    def get(self, name):
        return self.inner.get(name)

    def size(self, name):
        return self.inner.size(name)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, name):
        self.inner.delete(name)

    def location_exists(self):
        return self.inner.location_exists()

    def child(self, sub):
        return FailingStorage(self.inner.child(sub), 0, self.budget)


@contextlib.contextmanager
def raises_injected(match: str = "injected failure"):
    """The save fails because of the injected failure, raised as is or wrapped (StorageError)."""
    with pytest.raises((InjectedFailure, sp.StorageError), match=match) as ei:
        yield ei
    e, chain = ei.value, []
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, InjectedFailure) for x in chain), chain


def _state(seed):
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 8), "b": torch.randn(8).bfloat16(), "extra": {"seed": seed}}


def _data_bytes(state) -> int:
    mem = MemoryStorage()
    sp.save(mem, state)
    return sum(sp.read_manifest(mem).files.values())


def _load(storage):
    state = {"w": None, "b": None, "extra": None}
    sp.load(storage, state)
    return state


def _assert_state(got, want):
    assert_same_tensor(want["w"], got["w"], "w")
    assert_same_tensor(want["b"], got["b"], "b")
    assert got["extra"] == want["extra"]


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path):
    """A factory of storage instances that all view the same checkpoint location."""
    if request.param == "local":
        return lambda: LocalStorage(str(tmp_path / "ck"))
    mem = MemoryStorage()
    return lambda: mem


def test_failed_first_save_mid_data_is_incomplete(tmp_path):
    path = str(tmp_path / "ck")
    with raises_injected(match="injected failure after 100 bytes"):
        sp.save(FailingStorage(LocalStorage(path), 100), _state(1))
    with pytest.raises(sp.IncompleteCheckpointError, match="holds no committed manifest"):
        _load(LocalStorage(path))
    assert LocalStorage(path).list("data/") == []  # the aborted writer removed its partial file


def test_failed_first_save_at_commit_is_incomplete(backend):
    state = _state(1)
    with raises_injected(match="manifest.json"):
        sp.save(FailingStorage(backend(), _data_bytes(state)), state)
    # data and index durable, no manifest
    assert sorted(n.rsplit(".", 1)[1] for n in backend().list("data/")) == ["bin", "idx"]
    with pytest.raises(sp.IncompleteCheckpointError):
        _load(backend())


@pytest.mark.parametrize("where", ["mid-data", "at-commit"])
def test_failed_overwrite_keeps_previous(backend, where):
    old, new = _state(1), _state(2)
    sp.save(backend(), old)
    before = sp.read_manifest(backend())
    limit = 100 if where == "mid-data" else _data_bytes(new)
    with raises_injected():
        sp.save(FailingStorage(backend(), limit), new)
    after = sp.read_manifest(backend())
    assert after.save_id == before.save_id
    _assert_state(_load(backend()), old)
    # then a successful overwrite switches to the new values and, with no grace period, cleans every orphan
    res = sp.save(backend(), new, commit=sp.CommitPolicy(cleanup_grace_s=0))
    _assert_state(_load(backend()), new)
    m = sp.read_manifest(backend())
    assert m.save_id == res.save_id != before.save_id
    assert backend().list("data/") == sorted(m.files)
    assert backend().list() == sorted([*m.files, "manifest.json"])


def test_successful_overwrite(backend):
    a, b = _state(1), _state(2)
    sp.save(backend(), a)
    first = set(sp.read_manifest(backend()).files)
    sp.save(backend(), b)
    _assert_state(_load(backend()), b)
    files = sp.read_manifest(backend()).files
    # The replaced checkpoint's files outlive the commit by the grace period (its readers may need them).
    assert backend().list("data/") == sorted(first | set(files))
    assert not first & set(files)
    sp.save(backend(), a, commit=sp.CommitPolicy(cleanup_grace_s=0))
    _assert_state(_load(backend()), a)
    assert backend().list("data/") == sorted(sp.read_manifest(backend()).files)
    assert backend().list() == sorted([*sp.read_manifest(backend()).files, "manifest.json"])  # the claim is gone


def test_load_drops_stale_optimizer_state(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optim": opt})  # saved before any step: no state
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    sp.load(path, {"model": m, "optim": opt})
    assert len(opt.state) == 0


def test_unsupported_dtype_rejected_before_writing(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"t": torch.ones(3)})
    with pytest.raises(sp.UnsupportedStateError, match=r"tensor 'bad\.u' has dtype torch\.uint16"):
        sp.save(path, {"bad": {"u": torch.ones(3, dtype=torch.uint16)}})
    out = sp.load(path, {"t": None})  # the earlier checkpoint is untouched
    assert torch.equal(out["t"], torch.ones(3))


def test_corrupt_block_of_a_span_read_straight_into_place(tmp_path):
    """A span read into its destination is verified block by block by its reader; the bad block is named."""
    from shardpoint.planning.reads import SMALL_SPAN

    t = torch.arange(200_000, dtype=torch.float32)
    assert t.numel() * 4 > SMALL_SPAN  # read alone, straight into the destination
    path = str(tmp_path / "ck")
    block = 64 << 10
    sp.save(path, {"w": t}, block_size=block)
    state = {"w": torch.zeros_like(t)}
    rep = sp.load(path, state, return_result=True)
    assert torch.equal(state["w"], t)
    assert rep.bytes_read == t.numel() * 4
    chunk = _chunk_of(path, "w")
    _flip(path, chunk.file, chunk.offset + 5 * block + 3)
    with pytest.raises(
        sp.CorruptCheckpointError,
        match=rf"checksum mismatch in {re.escape(chunk.file)} bytes \[{chunk.offset + 5 * block}, {chunk.offset + 6 * block}\) "
        rf"of tensor 'w'",
    ):
        sp.load(path, {"w": torch.zeros_like(t)})
