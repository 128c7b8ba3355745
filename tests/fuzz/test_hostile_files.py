"""Links, FIFOs, devices and crafted metadata, through every entry point.

Each case replaces one file of a small checkpoint (or edits its manifest and
re-seals it) and runs ``sp.load``, ``sp.read_tensor``, ``shardpoint verify``
and ``shardpoint inspect`` against it under a time bound. Each must end in a
typed error that names the file or field (the CLI: exit 2, or 1 for damage
``verify`` found, with one line on stderr and no traceback).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import shardpoint as sp
from shardpoint.cli import main
from shardpoint.format.manifest import seal

from .harness import TrialTimeout, copy_checkpoint, fresh_state, save_small, time_bound


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    path = str(root / "orig")
    save_small(path)
    outside = root / "outside"
    shutil.copytree(path, outside)  # identical copies of every file, outside the checkpoint
    return path, str(outside)


def _names(path: str) -> dict:
    data = sorted(f for f in os.listdir(os.path.join(path, "data")))
    return {"DATA": f"data/{[f for f in data if f.endswith('.bin')][0]}", "INDEX": f"data/{[f for f in data if f.endswith('.idx')][0]}"}


def _fifo(f, outside):
    os.mkfifo(f)


def _link(target):
    return lambda f, outside: os.symlink(target if target.startswith("/") else os.path.join(outside, target), f)


CASES = {
    "data is a FIFO": ("DATA", _fifo),
    "index is a FIFO": ("INDEX", _fifo),
    "manifest is a FIFO": ("manifest.json", _fifo),
    "data links to a FIFO": ("DATA", lambda f, o: (os.mkfifo(os.path.join(o, "fifo")), os.symlink(os.path.join(o, "fifo"), f))),
    "manifest links to /dev/zero": ("manifest.json", _link("/dev/zero")),
    "index links to /dev/zero": ("INDEX", _link("/dev/zero")),
    "data links to /dev/zero": ("DATA", _link("/dev/zero")),
    "data links to /etc/passwd": ("DATA", _link("/etc/passwd")),
    "data links to an outside copy of itself": ("DATA", lambda f, o: os.symlink(os.path.join(o, os.path.relpath(f, os.path.dirname(os.path.dirname(f)))), f)),
    "manifest links to an outside copy": ("manifest.json", _link("manifest.json")),
    "data/ links to an outside copy": ("data", _link("data")),
    "data is a directory": ("DATA", lambda f, o: os.mkdir(f)),
    "manifest is a directory": ("manifest.json", lambda f, o: os.mkdir(f)),
}


def _prepare(original, tmp_path, case) -> tuple[str, str]:
    path, outside = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    rel, make = CASES[case]
    rel = _names(trial).get(rel, rel)
    f = os.path.join(trial, rel)
    shutil.rmtree(f) if os.path.isdir(f) else os.unlink(f)
    make(f, outside)
    return trial, rel


def _typed(fn) -> sp.CheckpointError:
    try:
        with time_bound():
            fn()
    except sp.CheckpointError as e:
        return e
    except TrialTimeout:
        pytest.fail("hung")
    pytest.fail("loaded without an error")


@pytest.mark.parametrize("case", list(CASES))
def test_special_file_is_refused_everywhere(original, tmp_path, capfd, case):
    trial, rel = _prepare(original, tmp_path, case)
    top = rel.split("/")[0] if case.startswith("data/") else rel
    for fn in (lambda: sp.load(trial, fresh_state()), lambda: sp.read_tensor(trial, "model.0.weight")):
        e = _typed(fn)
        assert top in str(e) and isinstance(e, (sp.UnsafeCheckpointError, sp.IncompleteCheckpointError)), e
    for cmd in (["verify", trial, "-q"], ["inspect", trial]):
        capfd.readouterr()
        with time_bound():
            rc = main(cmd)
        err = capfd.readouterr().err
        if rel.startswith("data") and cmd[0] == "verify" and rc == 1:
            continue  # verify read the manifest and reported the bad data or index file as damage
        if rel.endswith(".bin") and cmd[0] == "inspect" and rc == 0:
            continue  # inspect reads metadata only: it never opens (so never blocks on) a data file
        assert rc == 2, (cmd, rc, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err


def _edited(original, tmp_path, fn) -> str:
    path, _ = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    mp = os.path.join(trial, "manifest.json")
    raw = open(mp, "rb").read()
    doc = json.loads(raw)
    doc.pop("digest")
    text = fn(doc)
    body = text if isinstance(text, bytes) else json.dumps(doc, separators=(",", ":")).encode()
    open(mp, "wb").write(seal(body))
    return trial


def _replace_text(old: bytes, new: bytes):
    def fn(doc):
        body = json.dumps(doc, separators=(",", ":")).encode()
        assert old in body
        return body.replace(old, new, 1)
    return fn


def _set(*path_and_value):
    *path, value = path_and_value

    def fn(doc):
        d = doc
        for p in path[:-1]:
            d = d[p]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return fn


CRAFTED = {
    "created with 400 digits": (_replace_text(b'"created":', b'"created":' + b"9" * 400 + b',"c":'), sp.FormatError, "400 digits"),
    "an int of 5000 digits": (_replace_text(b'"world_size":1', b'"world_size":1' + b"0" * 5000), sp.FormatError, "5001 digits"),
    "NaN": (_replace_text(b'"created":', b'"created":NaN,"c":'), sp.FormatError, "NaN"),
    "Infinity": (_replace_text(b'"created":', b'"created":-Infinity,"c":'), sp.FormatError, "Infinity"),
    "1e999": (_replace_text(b'"created":', b'"created":1e999,"c":'), sp.FormatError, "float64 range"),
    "duplicate key": (_replace_text(b'"created":', b'"created":1,"created":'), sp.FormatError, "duplicate key 'created'"),
    "lone surrogate in a name": (_replace_text(b'"model.0.weight"', b'"model.0.weight\\ud800"'), sp.FormatError, "lone surrogate"),
    "deep nesting": (_replace_text(b'"layout":', b'"layout":' + b"[" * 5000 + b"]" * 5000 + b',"l":'), sp.FormatError, "not valid JSON|nesting"),
    "a long string": (_replace_text(b'"layout":', b'"layout":"' + b"a" * (17 << 20) + b'","l":'), sp.FormatError, "exceeds the limit"),
    "shape of 2**48 elements": (_replace_text(b'"shape":[7]', b'"shape":[281474976710656]'), sp.FormatError, "needs 1125899906842624 bytes"),
    "optimizer document missing": (_set("values", "optim", KeyError), sp.CheckpointError, "optim"),
    "optimizer groups=5": (_set("values", "optim", "groups", 5), sp.FormatError, "field 'groups'"),
    "optimizer group_of not an int": (lambda d: d["values"]["optim"]["group_of"].update({k: "0" for k in d["values"]["optim"]["group_of"]}), sp.FormatError, "field 'group_of"),
    "optimizer group is a list": (lambda d: d["values"]["optim"]["groups"].__setitem__(0, [1, 2]), sp.FormatError, "field 'groups.0'"),
    "optimizer group_of out of range": (lambda d: d["values"]["optim"]["group_of"].update({k: 3 for k in d["values"]["optim"]["group_of"]}), sp.FormatError, "group index"),
    "optimizer without values": (_set("values", "optim", None), sp.FormatError, "value document is missing"),
    "optimizer state entry a list": (lambda d: d["values"]["optim"]["state"].update({k: [] for k in d["values"]["optim"]["state"]}), sp.FormatError, "field 'state."),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_metadata_is_a_typed_error(original, tmp_path, capfd, case):
    fn, kind, match = CRAFTED[case]
    trial = _edited(original, tmp_path, fn)
    e = _typed(lambda: sp.load(trial, fresh_state()))
    assert isinstance(e, kind), e
    import re

    assert re.search(match, str(e)) and str(e).startswith(trial), e
    if kind is sp.FormatError and "optimizer" not in case:
        assert isinstance(_typed(lambda: sp.read_tensor(trial, "model.0.weight")), sp.FormatError)
        capfd.readouterr()
        with time_bound():
            assert main(["inspect", trial]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_oversized_manifest_is_refused_before_reading(original, tmp_path, monkeypatch):
    path, _ = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    size = os.path.getsize(os.path.join(trial, "manifest.json"))
    monkeypatch.setenv("SHARDPOINT_MAX_MANIFEST_BYTES", str(size - 1))
    e = _typed(lambda: sp.read_manifest(trial))
    assert isinstance(e, sp.UnsafeCheckpointError) and "manifest.json" in str(e) and f"limit of {size - 1}" in str(e)
    monkeypatch.setenv("SHARDPOINT_MAX_MANIFEST_BYTES", str(size))
    assert sp.read_manifest(trial).format_version == 3


def test_sparse_huge_manifest_is_refused_without_reading(original, tmp_path):
    path, _ = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    with open(os.path.join(trial, "manifest.json"), "r+b") as f:
        f.truncate(1 << 40)  # a 1 TiB sparse file: reading it would never end
    e = _typed(lambda: sp.load(trial, fresh_state()))
    assert isinstance(e, sp.UnsafeCheckpointError) and "1099511627776 bytes" in str(e)


@pytest.mark.parametrize("to", ["dcp", "hf", "torch"])
def test_export_of_a_corrupt_checkpoint_leaves_nothing(original, tmp_path, capfd, to):
    path, _ = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    (c,) = sp.read_manifest(trial).tensors["model.0.weight"].chunks  # a tensor every format exports
    data = os.path.join(trial, c.file)
    raw = bytearray(open(data, "rb").read())
    raw[c.offset + c.nbytes // 2] ^= 0xFF
    open(data, "wb").write(raw)
    out = tmp_path / "out"
    capfd.readouterr()
    with time_bound(30):
        rc = main(["export", trial, "--to", to, str(out), "-q"])
    err = capfd.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["t"], "no output and no temporary folder left behind"


@pytest.mark.parametrize("case", ["data is a FIFO", "manifest is a FIFO", "index links to /dev/zero", "data/ links to an outside copy"])
def test_fsspec_local_files_are_opened_as_safely(original, tmp_path, case):
    from fsspec.implementations.local import LocalFileSystem

    from shardpoint.storage.fsspec_bridge import FsspecStorage

    trial, rel = _prepare(original, tmp_path, case)
    st = FsspecStorage(LocalFileSystem(), trial)
    for fn in (lambda: sp.load(st, fresh_state()), lambda: sp.read_tensor(st, "model.0.weight")):
        e = _typed(fn)
        assert isinstance(e, sp.UnsafeCheckpointError) and rel.split("/")[0] in str(e), e
