"""Random single-bit flips and truncations of every file of a small checkpoint.

Each trial copies the checkpoint, damages one file (one bit flipped anywhere,
or the file cut at a random length), and loads it into a fresh state (even
trials) or reads every tensor by name with ``sp.read_tensor`` (odd trials). It must
end in an exact load or a typed error within the time bound: never a silent
wrong load, an untyped exception or a hang.

    SHARDPOINT_FUZZ_TRIALS=500 python -m pytest -q tests/fuzz/test_bitflips.py -s   # the full run
"""

from __future__ import annotations

import os
import random

import pytest

from .harness import SEED, TRIALS, Tally, copy_checkpoint, load_verdict, read_verdict, save_small, tensors_by_name


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "orig")
    want = save_small(path)
    files = sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )
    return path, want, files, tensors_by_name(path)


def _damage(path: str, rel: str, rng: random.Random) -> str:
    f = os.path.join(path, rel)
    data = bytearray(open(f, "rb").read())
    if rng.random() < 0.75 and data:
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        what = f"flip bit {bit} of {rel} ({len(data)} bytes)"
    else:
        n = rng.randrange(len(data)) if data else 0
        del data[n:]
        what = f"truncate {rel} to {n} bytes"
    with open(f, "wb") as fh:
        fh.write(data)
    return what


def test_bit_flips_and_truncations_all_end_exact_or_typed(original, tmp_path):
    path, want, files, by_name = original
    assert any(f.endswith(".idx") for f in files) and "manifest.json" in files
    rng = random.Random(SEED)
    tally = Tally()
    for i in range(TRIALS):
        trial = copy_checkpoint(path, str(tmp_path / "t"))
        # Every file gets trials: the manifest and index files as often as the data files.
        what = _damage(trial, files[i % len(files)], rng)
        # Alternate the entry points: a whole load, and every tensor read by name.
        verdict = load_verdict(trial, want) if i % 2 == 0 else read_verdict(trial, by_name)
        tally.add(f"trial {i}: {what}", verdict)
    print(f"\nbit flips and truncations (seed {SEED}, {TRIALS} trials): {tally.line()}")
    assert tally.passed == tally.total == TRIALS, "\n".join(tally.failures)
    # The trials really damaged things: most end in a typed error.
    assert tally.counts["typed"] > TRIALS // 2


def test_bit_flips_of_a_two_writer_converted_checkpoint(tmp_path):
    """The same, for a checkpoint a converter wrote over two writer ranks (holders, two index files)."""
    import torch

    from shardpoint.convert.common import CheckpointWriter
    from shardpoint.geometry import Box

    path = str(tmp_path / "conv")
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    with CheckpointWriter(path, block_size=64) as cw:
        cw.add("model.w", w[:5], shape=(8, 6), box=Box((0, 0), (5, 6)), rank=0)
        cw.add("model.w", w[5:], shape=(8, 6), box=Box((5, 0), (3, 6)), rank=1)
        cw.add("model.b", torch.arange(6, dtype=torch.int16), rank=1)
        cw.commit()
    by_name = tensors_by_name(path)
    assert torch.equal(by_name["model.w"], w)
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    assert sum(f.endswith(".idx") for f in files) == 2
    rng = random.Random(SEED + 3)
    tally = Tally()
    n = max(50, TRIALS // 4)
    for i in range(n):
        trial = copy_checkpoint(path, str(tmp_path / "t"))
        what = _damage(trial, files[i % len(files)], rng)
        tally.add(f"trial {i}: {what}", read_verdict(trial, by_name))
    print(f"\nconverted checkpoint, bit flips and truncations (seed {SEED}, {n} trials): {tally.line()}")
    assert tally.passed == tally.total == n, "\n".join(tally.failures)
