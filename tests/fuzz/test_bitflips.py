"""Random single-bit flips and truncations of every file of a small checkpoint.

Each trial copies the checkpoint, damages one file (one bit flipped anywhere,
or the file cut at a random length), and loads it into a fresh state. It must
end in an exact load or a typed error within the time bound: never a silent
wrong load, an untyped exception or a hang.

    SHARDPOINT_FUZZ_TRIALS=500 python -m pytest -q tests/fuzz/test_bitflips.py -s   # the full run
"""

from __future__ import annotations

import os
import random

import pytest

from .harness import SEED, TRIALS, Tally, copy_checkpoint, load_verdict, save_small


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "orig")
    want = save_small(path)
    files = sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )
    return path, want, files


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
    path, want, files = original
    assert any(f.endswith(".idx") for f in files) and "manifest.json" in files
    rng = random.Random(SEED)
    tally = Tally()
    for i in range(TRIALS):
        trial = copy_checkpoint(path, str(tmp_path / "t"))
        # Every file gets trials: the manifest and index files as often as the data files.
        what = _damage(trial, files[i % len(files)], rng)
        tally.add(f"trial {i}: {what}", load_verdict(trial, want))
    print(f"\nbit flips and truncations (seed {SEED}, {TRIALS} trials): {tally.line()}")
    assert tally.passed == tally.total == TRIALS, "\n".join(tally.failures)
    # The trials really damaged things: most end in a typed error.
    assert tally.counts["typed"] > TRIALS // 2
