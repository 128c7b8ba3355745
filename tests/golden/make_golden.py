"""Write the committed format-version-1 golden checkpoint and its expected values.

    python -m tests.golden.make_golden        # from the repository root

Writes ``tests/golden/v1/`` (a checkpoint saved by ``shardpoint.save`` from one
process) and, next to it, ``v1_expected.safetensors`` (every tensor, bit-exact)
and ``v1_expected.json`` (plain values and optimizer hyper-parameters). The
output is byte-for-byte reproducible: the seed is fixed and the save id and
timestamp are pinned while saving.

Only regenerate on purpose. ``test_golden.py`` checks that today's shardpoint
still loads what an earlier one wrote; regenerating hides exactly the kind of
break it exists to catch. A format change needs a new ``vN`` folder instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import uuid
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file
from torch import nn

HERE = Path(__file__).resolve().parent
SAVE_ID = uuid.UUID("5eed0000-0000-4000-8000-000000000001")
CREATED = 1_700_000_000.0

# Plain values that are not JSON-native, written in the expected file as [kind, data].
SPECIAL = {
    "betas": ("tuple", [0.9, 0.999]),
    "by_epoch": ("intdict", [[1, "warmup"], [2, "decay"]]),
    "blob": ("hex", "00ff676f6c64656e"),
    "dtype": ("dtype", "bfloat16"),
    "inf": ("float", "inf"),
    "nan": ("float", "nan"),
}
PLAIN = {"step": 1, "name": "golden-v1 ✓", "lrs": [0.001, 0.0005], "nested": {"a": [1, 2, {"b": None}], "flag": True}}


def special_value(kind: str, data):
    """Turn an expected ``[kind, data]`` pair into the Python value it stands for."""
    if kind == "tuple":
        return tuple(data)
    if kind == "intdict":
        return {int(k): v for k, v in data}
    if kind == "hex":
        return bytes.fromhex(data)
    if kind == "dtype":
        return getattr(torch, data)
    if kind == "float":
        return float(data)
    raise ValueError(kind)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def build_state() -> dict:
    """The state that was saved: deterministic on CPU for a given torch build."""
    torch.manual_seed(1234)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.85, 0.97), weight_decay=0.05)
    x = torch.randn(5, 4)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    extra = dict(PLAIN)
    extra.update({k: special_value(*v) for k, v in SPECIAL.items()})
    extra["bf16"] = torch.randn(3, 5).bfloat16()
    extra["scalar"] = torch.tensor(-2.5, dtype=torch.float64)
    extra["int_scalar"] = torch.tensor(7, dtype=torch.int64)
    extra["mask"] = torch.tensor([[True, False], [False, True]])
    return {"model": model, "optim": opt, "extra": extra}


def expected_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a stable name (manifest names where they exist)."""
    model, opt = state["model"], state["optim"]
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optim.state.{names[id(p)]}.{k}"] = v
    for k, v in state["extra"].items():
        if isinstance(v, torch.Tensor):
            out[f"extra.{k}"] = v
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def expected_json(state: dict) -> dict:
    groups = []
    for g in state["optim"].param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"})
    assert all(isinstance(v, (int, float)) and math.isfinite(v) or not isinstance(v, float) for g in groups for v in g.values())
    return {
        "format_version": 1,
        "plain": PLAIN,
        "special": {k: list(v) for k, v in SPECIAL.items()},
        "optim_groups": groups,
        "tensor_names": sorted(expected_tensors(state)),
    }


def write(out_dir: Path, name: str = "v1") -> Path:
    """Save the golden checkpoint into ``out_dir/name`` (replacing it) plus the expected files."""
    import shardpoint as sp

    ckpt = out_dir / name
    if ckpt.exists():
        shutil.rmtree(ckpt)
    state = build_state()
    with mock.patch("uuid.uuid4", return_value=SAVE_ID), mock.patch("time.time", return_value=CREATED):
        sp.save(str(ckpt), state)
    save_file(expected_tensors(state), str(out_dir / f"{name}_expected.safetensors"))
    with open(out_dir / f"{name}_expected.json", "w", encoding="utf-8") as f:
        json.dump(expected_json(state), f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    return ckpt


def main() -> None:
    ckpt = write(HERE)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(HERE) for f in fs if "__pycache__" not in d)
    print(f"wrote {ckpt} ({total} bytes in tests/golden)", file=sys.stderr)


if __name__ == "__main__":
    main()
