"""DeepSpeed ZeRO 1/2/3 saved and loaded across layouts and world sizes, as real gloo processes.

Sources are saved on 2 ranks: ZeRO-1, ZeRO-2 and ZeRO-3 engines (with
``sp.save`` and with DeepSpeed's own ``save_checkpoint``), variants
(``-rr`` round-robin gradient order, ``-sg`` several ZeRO-3 sub-groups and no
persistent parameters, ``-bf16`` bf16 training with fp32 masters) and FSDP2.
Each launch then loads several of them into other layouts and world sizes and
checks them bit for bit against the source's full reference, and the next
two losses against the source's. Skipped when DeepSpeed is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from shardpoint.testing import launch
from tests.dist.checks import check_ranks_agree

# Only the launched ranks import DeepSpeed (it takes seconds and touches global torch state).
pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _fp16_supported() -> bool:
    """What DeepSpeed's CPU accelerator checks before it accepts an fp16 config (a CPU feature)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the op: DeepSpeed says no too
        return False


# fp16 ZeRO runs only where the CPU has mkldnn fp16 support; elsewhere DeepSpeed refuses
# the config ("Type fp16 is not supported on your device"), so those cases are left out.
FP16 = _fp16_supported()


def _cases(cases):
    return [c for c in cases if FP16 or not any("fp16" in x for x in c)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("deepspeed"))
    info = launch(
        2, "tests.dist.deepspeed_cases:save_job",
        {
            "root": root,
            "layouts": ["zero1", "zero2", "zero3", "fsdp2", "zero2-rr", "zero3-sg", "zero1-bf16"] + (["zero3-fp16"] if FP16 else []),
            "native": ["zero1", "zero3", "zero2-rr"] + (["zero3-fp16"] if FP16 else []),
        },
    )[0]
    return root, info


def test_zero_saves_flat_slices_without_gather(saved):
    _, info = saved
    total = info["fsdp22"]["total"]
    for name in ("zero12", "zero22", "zero32", "zero2-rr2", "zero3-sg2", "zero1-bf162") + (("zero3-fp162",) if FP16 else ()):
        # The same logical tensors as FSDP2's, each stored once, as flat ranges of the partitions
        # (fp16 skipped both steps: no optimizer state yet).
        if name != "zero3-fp162":
            assert info[name]["total"] == total, (name, info[name], total)
        assert info[name]["flat_chunks"] > 0, info[name]
        assert info[name]["entries"]["model"].startswith("deepspeed_zero"), info[name]["entries"]
        skipped = 2 if name == "zero3-fp162" else 0  # fp16 from a loss scale of 2**16: both steps overflow
        assert info[name]["model_doc"] == {"deepspeed": {"global_steps": 2, "global_samples": 16, "skipped_steps": skipped}}
    assert info["fsdp22"]["flat_chunks"] == 0


@pytest.mark.parametrize(
    "world,cases",
    [
        (1, [
            ["zero32", "single"], ["zero32.native", "single"], ["zero12", "zero3"], ["zero1-bf162", "zero3-bf16"],
            ["zero3-fp162", "zero1-fp16"],
        ]),
        pytest.param(3, [
            ["zero12", "fsdp2"], ["fsdp22", "zero2"], ["zero32", "zero1"], ["zero12.native", "fsdp2"],
            ["zero22", "zero3"], ["zero3-sg2", "zero3-sg"], ["zero2-rr2.native", "zero1-rr"],
        ], marks=pytest.mark.slow),  # the longest: in `make test-slow`, which CI runs
        (2, [
            ["fsdp22", "zero1"], ["zero32.native", "zero2"], ["zero22", "tp"], ["zero2-rr2", "fsdp2"],
            ["zero3-fp162.native", "zero2-fp16"],
        ]),
    ],
    ids=["to1", "to3", "to2"],
)
def test_deepspeed_reshard(saved, world, cases):
    root, _ = saved
    cases = _cases(cases)
    results = launch(world, "tests.dist.deepspeed_cases:load_job", {"root": root, "cases": cases})
    check_ranks_agree(results, cases, world)


@pytest.mark.skipif(not FP16, reason="this CPU has no mkldnn fp16 support, so DeepSpeed refuses fp16 configs on it")
def test_fp16_cases_are_in_the_matrix(saved):
    _, info = saved
    assert info["zero3-fp162"]["model_doc"]["deepspeed"]["skipped_steps"] == 2


def test_zero_state_needs_engine_and_optimizer_together(tmp_path):
    results = launch(2, "tests.dist.deepspeed_cases:errors_job", {"root": str(tmp_path)})
    for r in results:
        assert r["module_alone"] is not None and "pass the engine" in r["module_alone"], r
        assert r["optimizer_alone"] is not None and "needs its model" in r["optimizer_alone"], r
        assert r["same_names"] and r["names"] > 0, r


def test_lazy_saves_copy_zero_state_after_the_call_and_fence_the_step(tmp_path):
    results = launch(2, "tests.dist.deepspeed_cases:lazy_job", {"root": str(tmp_path), "layouts": ["zero2", "zero3"]})
    for r in results:
        for layout in ("zero2", "zero3"):
            got = r[layout]
            assert got["keys"] > 0 and got["differ"] == [] and got["step_ran"], (layout, got)
            assert got["torn"] is not None and "optimizer.state." in got["torn"], (layout, got)
