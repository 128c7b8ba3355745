"""Static check: accelerator knowledge lives in ``shardpoint/device/`` only.

Reading the RNG state of CUDA generators in ``training/rng.py`` is one exception; the
other is ``runtime/torchcompat.py``, which fills in stream methods an older torch lacks.
The scan reads every source line, comments and docstrings included, so that
a device concept cannot creep into another module even in prose.
"""

from __future__ import annotations

import pathlib
import re

import shardpoint

PKG = pathlib.Path(shardpoint.__file__).resolve().parent

DEVICE_WORDS = re.compile(
    r"\bcuda\b|pin_memory|is_pinned|\bpinned\b|page-locked|non_blocking|record_stream|wait_stream|wait_event"
    r"|current_stream|torch\.Stream|torch\.Event|torch\.accelerator|copy stream|training stream",
    re.IGNORECASE,
)
ALLOWED = ("device/", "training/rng.py", "runtime/torchcompat.py")


def device_words(root: pathlib.Path = PKG) -> list[str]:
    """``path:line: word`` for each device word outside the device package (and ``training/rng.py``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found.extend(f"{rel}:{i}: {m.group(0)}" for m in DEVICE_WORDS.finditer(line))
    return found


def test_device_words_only_in_the_device_package():
    assert (PKG / "device" / "accelerator.py").exists()
    assert device_words() == []


def test_the_device_word_scan_finds_a_planted_violation(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "device").mkdir()
    (tmp_path / "engine" / "x.py").write_text(
        "import torch\n"
        "buf = torch.empty(8, pin_memory=True)\n"
        "# copy on a side stream\n"
        "with torch.cuda.stream(s):\n"
        "    buf.copy_(t, non_blocking=True)\n"
        "torch.accelerator.current_stream().wait_event(ev)\n"
        "ok = 'streaming reads'\n"
    )
    (tmp_path / "device" / "y.py").write_text("import torch\ntorch.cuda.Stream()\n")
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "rng.py").write_text("torch.cuda.get_rng_state()\n")
    assert device_words(tmp_path) == [
        "engine/x.py:2: pin_memory",
        "engine/x.py:4: cuda",
        "engine/x.py:5: non_blocking",
        "engine/x.py:6: torch.accelerator",
        "engine/x.py:6: current_stream",
        "engine/x.py:6: wait_event",
    ]
