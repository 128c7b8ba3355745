"""Structured mutations of the manifest, the index files and the value documents.

Unlike a bit flip, each mutation here is re-sealed: the manifest's digest (and
an edited index file's trailer and recorded digest) are recomputed, as a
careless tool or an attacker would, so the mutation reaches the parser and the
validators behind the digests. A trial passes when it ends in a typed error or
a completed load, within the time bound; an untyped exception or a hang fails.
Edits that change what a tensor *is* (its name or dtype) must never load.
"""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
import xxhash

import shardpoint as sp
from shardpoint.format.manifest import seal

from .harness import SEED, STRUCTURED_TRIALS, Outcome, Tally, TrialTimeout, copy_checkpoint, load_verdict, save_small, time_bound

# Replacement values: wrong types, extremes, and the crafted numbers and names of known attacks.
JUNK = [
    None, True, False, 0, -1, 1, 7, 2**31, 2**63 - 1, -(2**63), 0.5, -0.0, 1e308, "", "x", "float32", "int32",
    "exp_cvg_sq", "\ud800", "a" * 300, [], [0], [-1], [2**48], [1, 2, 3], {}, {"__sp__": "tensor", "key": "nope"},
    {"__sp__": "int", "v": "9" * 50}, {"__sp__": "pickle", "b64": "gAR9lC4="}, {"__sp__": "bogus"}, [[0, 1]], [None],
]
# Raw JSON texts that json.dumps cannot produce.
RAW_JUNK = ["NaN", "Infinity", "-Infinity", "9" * 400, "1" + "0" * 5000, "1e999", '"\\ud800"', "[" * 300 + "]" * 300]


def _paths(doc, prefix=()):
    """Every (path, node) of a JSON tree."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _parent(doc, path):
    for p in path[:-1]:
        doc = doc[p]
    return doc


def _mutate(doc: dict, rng: random.Random, raws: list) -> str:
    """Apply one structured mutation in place; return its description.

    A raw token (text ``json.dumps`` cannot write) goes in as a placeholder
    string and is spliced in by :func:`_encode`.
    """
    paths = [p for p, _ in _paths(doc) if p and p[-1] != "digest"]
    path = rng.choice(paths)
    parent, key = _parent(doc, path), path[-1]
    op = rng.choice(["replace", "replace", "raw", "delete", "rename", "retype", "reshape", "copy"])
    where = ".".join(map(str, path))[:120]
    if op == "replace":
        parent[key] = rng.choice(JUNK)
    elif op == "raw":
        raws.append(rng.choice(RAW_JUNK))
        parent[key] = f"@@RAW{len(raws) - 1}@@"
    elif op == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "rename" and isinstance(parent, dict):
        parent[rng.choice(JUNK[14:20]) if rng.random() < 0.5 else f"{key}x"] = parent.pop(key)
    elif op == "retype":
        ts = list(doc.get("tensors", {}).values())
        if ts:
            rng.choice(ts)["dtype"] = rng.choice(["int32", "float32", "int64", "float64", "bfloat16", "bool", "uint8"])
    elif op == "reshape":
        ts = list(doc.get("tensors", {}).values())
        if ts:
            rng.choice(ts)["shape"] = rng.choice([[2**48], [0], [], [1, 1, 1], [3, 2**40], [7], [5, 6]])
    else:  # copy another node (possibly an ancestor: deep nesting) over this one
        src = rng.choice(paths)
        parent[key] = json.loads(json.dumps(_parent(doc, src)[src[-1]]))
    return f"{op} at {where}"


def _encode(doc: dict, raws: list) -> bytes:
    text = json.dumps(doc, separators=(",", ":"))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw)
    return text.encode("utf-8")


def _reseal(body: bytes) -> bytes:
    return seal(body)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("structured") / "orig")
    want = save_small(path)
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    doc = json.loads(raw)
    doc.pop("digest")
    return path, want, doc


def test_manifest_and_value_document_mutations(original, tmp_path):
    path, want, doc = original
    rng = random.Random(SEED + 1)
    tally = Tally()
    for i in range(STRUCTURED_TRIALS):
        d = json.loads(json.dumps(doc))
        # Half the trials aim at the value documents (the optimizer's included).
        raws: list = []
        what = "values: " + _mutate(d["values"], rng, raws) if i % 2 else _mutate(d, rng, raws)
        trial = copy_checkpoint(path, str(tmp_path / "t"))
        with open(os.path.join(trial, "manifest.json"), "wb") as f:
            f.write(_reseal(_encode(d, raws)))
        o = load_verdict(trial, want, exact=False)
        if o.ok and o.kind == "exact":
            o = _tensors_exact_or_typed(trial, want)
        tally.add(f"trial {i}: {what}", o)
    print(f"\nmanifest and value-document mutations (seed {SEED}, {STRUCTURED_TRIALS} trials): {tally.line()}")
    assert tally.passed == tally.total == STRUCTURED_TRIALS, "\n".join(tally.failures)


def _tensors_exact_or_typed(trial: str, want: dict) -> Outcome:
    """After a completed load of a re-sealed edit: every tensor read by name still holds saved bytes."""
    try:
        with time_bound():
            m = sp.read_manifest(trial, chunks=False)
            for name in list(m.tensors)[:40]:
                sp.read_tensor(trial, name)
    except sp.CheckpointError as e:
        return Outcome("typed", str(e)[:100])
    except TrialTimeout as e:
        return Outcome("hang", str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome("untyped", f"read_tensor: {type(e).__name__}: {str(e)[:300]}")
    return Outcome("exact", "completed")


def _index_files(path: str) -> list[str]:
    return sorted(f"data/{f}" for f in os.listdir(os.path.join(path, "data")) if f.endswith(".idx"))


def test_index_mutations_behind_recomputed_digests(original, tmp_path):
    """Index bytes edited and then re-digested (trailer, manifest entry, manifest seal)."""
    path, want, doc = original
    rng = random.Random(SEED + 2)
    tally = Tally()
    for i in range(STRUCTURED_TRIALS):
        trial = copy_checkpoint(path, str(tmp_path / "t"))
        (rel,) = _index_files(trial)[:1]
        data = bytearray(open(os.path.join(trial, rel), "rb").read())
        body = data[:-16]
        kind = rng.choice(["word", "word", "count", "cut", "grow"])
        if kind == "word":  # one aligned u64 set to a hostile value
            at = 8 * rng.randrange(1, len(body) // 8)
            struct.pack_into("<Q", body, at, rng.choice([0, 1, 2**32, 2**48, 2**62, 2**63, 2**64 - 1, rng.getrandbits(64)]))
        elif kind == "count":
            struct.pack_into("<Q", body, 8 * rng.choice([1, 2, 3]), rng.choice([0, 1, 2**40, 2**64 - 1]))
        elif kind == "cut":
            del body[rng.randrange(8, len(body)) :]
        else:
            body += bytes(8 * rng.randrange(1, 4))
        new = bytes(body) + xxhash.xxh3_128_digest(bytes(body))
        with open(os.path.join(trial, rel), "wb") as f:
            f.write(new)
        d = json.loads(json.dumps(doc))
        d["files"][rel] = len(new)
        for r in d["ranks"]:
            if r and r[1] == rel:
                r[2] = xxhash.xxh3_128_hexdigest(new)
        with open(os.path.join(trial, "manifest.json"), "wb") as f:
            f.write(_reseal(_encode(d, [])))
        o = load_verdict(trial, want, exact=True)
        tally.add(f"trial {i}: {kind} in {rel}", o)
    print(f"\nindex mutations (seed {SEED}, {STRUCTURED_TRIALS} trials): {tally.line()}")
    # An index edit that keeps every row valid and in place (e.g. a checksum word) must still be
    # caught by the data checksums: "wrong" fails here like an untyped error.
    assert tally.passed == tally.total == STRUCTURED_TRIALS, "\n".join(tally.failures)


RENAMES = [
    (b'"dtype":"float32"', b'"dtype":"int32"'),
    (b"exp_avg_sq", b"exp_cvg_sq"),
    (b'"model.0.weight"', b'"model.0.weighu"'),
    (b'"dtype":"float16"', b'"dtype":"bfloat16"'),
]


@pytest.mark.parametrize("old,new", RENAMES, ids=[n.decode() for _, n in RENAMES])
@pytest.mark.parametrize("reseal", [False, True], ids=["raw", "resealed"])
def test_consistent_rename_or_retype_never_loads(original, tmp_path, old, new, reseal):
    path, want, _ = original
    trial = copy_checkpoint(path, str(tmp_path / "t"))
    mp = os.path.join(trial, "manifest.json")
    raw = open(mp, "rb").read()
    assert old in raw
    if reseal:
        body = raw[: raw.rindex(b',"digest":')] + b"}"
        edited = seal(body.replace(old, new))
    else:
        edited = raw.replace(old, new)
    open(mp, "wb").write(edited)
    o = load_verdict(trial, want)
    assert o.kind == "typed", o
    # Read by name, the edited tensor is refused too: by the digest, or (re-sealed) because no
    # index row carries the new name or dtype.
    match = "index has no chunk|no chunk|provide 0 of" if reseal else "does not match its own digest"
    with pytest.raises(sp.CorruptCheckpointError, match=match):
        with time_bound():
            m = sp.read_manifest(trial, chunks=False)
            for name in m.tensors:
                sp.read_tensor(trial, name)


def _stateful_state():
    import torch

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return {
        "model": m,
        "opt": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, 2),
        "sampler": sp.ResumableSampler(50, seed=3),
        "rng": sp.RNGState(generators=("python",)),
        "extra": {"a": (1, 2), "b": {1: "x"}, "c": b"zz", "big": 2**70},
    }


def test_stateful_documents_of_samplers_schedulers_and_rng(tmp_path):
    """Value documents restored through objects' own load_state_dict: a refused document is a FormatError."""
    import random as pyrandom

    saved_random = pyrandom.getstate()
    try:
        st = _stateful_state()
        list(zip(range(7), iter(st["sampler"])))
        path = str(tmp_path / "orig")
        sp.save(path, st)
        doc = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
        doc.pop("digest")
        rng = random.Random(SEED + 4)
        tally = Tally()
        n = max(50, STRUCTURED_TRIALS // 2)
        for i in range(n):
            d = json.loads(json.dumps(doc))
            raws: list = []
            what = _mutate(d["values"] if i % 2 else d, rng, raws)
            trial = copy_checkpoint(path, str(tmp_path / "t"))
            with open(os.path.join(trial, "manifest.json"), "wb") as f:
                f.write(_reseal(_encode(d, raws)))
            try:
                with time_bound():
                    sp.load(trial, _stateful_state())
                o = Outcome("exact", "completed")
            except sp.CheckpointError as e:
                o = Outcome("typed", str(e)[:100])
            except TrialTimeout as e:
                o = Outcome("hang", str(e))
            except Exception as e:  # noqa: BLE001
                o = Outcome("untyped", f"{type(e).__name__}: {str(e)[:300]}")
            tally.add(f"trial {i}: {what}", o)
        print(f"\nstateful value-document mutations (seed {SEED}, {n} trials): {tally.line()}")
        assert tally.passed == tally.total == n, "\n".join(tally.failures)
    finally:
        pyrandom.setstate(saved_random)
