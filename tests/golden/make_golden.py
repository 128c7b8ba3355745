"""Write a committed golden checkpoint of one format version and its expected values.

    python -m tests.golden.make_golden --version 3     # from the repository root

Version 1 (``tests/golden/v1/``) was saved by ``shardpoint.save`` from one
process, by a shardpoint that wrote format version 1. Version 2
(``tests/golden/v2/``) is saved from 2 gloo ranks: an FSDP2 model with uneven
and empty shards, AdamW state, replicated tensors and plain values, and a
DTensor copied over a sub-mesh (written with ``holders``, not a grid). Next to
each folder, ``vN_expected.safetensors`` holds every tensor, full and
bit-exact, and ``vN_expected.json`` the plain values and optimizer
hyper-parameters. Version 3 (``tests/golden/v3/``) is the version-2 state
saved the same way by a shardpoint that writes version 3: its manifest ends
with its own digest and its index keys bind each tensor's dtype. The output is byte-for-byte reproducible: seeds are fixed
and the save ids and timestamp are pinned while saving.

Only regenerate on purpose. ``test_golden.py`` checks that today's shardpoint
still loads what an earlier one wrote; regenerating hides exactly the kind of
break it exists to catch. A format change needs a new ``vN`` folder instead,
and a folder can only be written by a shardpoint whose writer produces that
version (today's writes version 3, so ``v1`` and ``v2`` can no longer be regenerated).
"""

from __future__ import annotations

import argparse
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
    return {"model": model, "optim": opt, "extra": _extra(PLAIN)}


def _extra(plain: dict) -> dict:
    """The ``extra`` entry: plain and special values, and small tensors drawn from the seeded generator."""
    extra = dict(plain)
    extra.update({k: special_value(*v) for k, v in SPECIAL.items()})
    extra["bf16"] = torch.randn(3, 5).bfloat16()
    extra["scalar"] = torch.tensor(-2.5, dtype=torch.float64)
    extra["int_scalar"] = torch.tensor(7, dtype=torch.int64)
    extra["mask"] = torch.tensor([[True, False], [False, True]])
    return extra


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


# ---------------------------------------------------------------- version 2
V2_WORLD = 2
# One save id per rank (each names its own files); rank 0's becomes the manifest's.
V2_IDS = (uuid.UUID("5eed0000-0000-4000-8000-000000000002"), uuid.UUID("5eed0000-0000-4000-8000-000000000003"))
V3_IDS = (uuid.UUID("5eed0000-0000-4000-8000-000000000004"), uuid.UUID("5eed0000-0000-4000-8000-000000000005"))
PLAIN_V2 = {**PLAIN, "name": "golden-v2 ✓"}
PLAIN_V3 = {**PLAIN, "name": "golden-v3 ✓"}
V2_EXTRA_TENSORS = ("bf16", "scalar", "int_scalar", "mask", "submesh")
# Written with holders: a copy per "dp" rank of a (dp, tp) mesh, which no grid describes.
V2_HOLDERS = ("extra.submesh",)


def build_model_v2() -> nn.Module:
    # Under FSDP2 on 2 ranks: 5 rows split 3 + 2, and the last layer's 1 row leaves rank 1 empty.
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3), nn.Linear(3, 1))


def build_state_v2(world: int, plain: dict | None = None) -> dict:
    """The state each rank saved: deterministic on CPU for a given torch build."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(1234)
    model = build_model_v2()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.85, 0.97), weight_decay=0.05)
    x = torch.randn(6, 4)  # the same batch on every rank: BatchNorm buffers stay replicated
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    extra = _extra(PLAIN_V2 if plain is None else plain)
    tp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
    extra["submesh"] = distribute_tensor(torch.randn(2, 3).half(), tp, [Shard(0)])
    return {"model": model, "optim": opt, "extra": extra}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone().contiguous()


def expected_tensors_v2(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor, gathered whole (a collective: call on every rank in the same order)."""
    model, opt = state["model"], state["optim"]
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optim.state.{names[id(p)]}.{k}"] = _full(v)
    for k in V2_EXTRA_TENSORS:
        out[f"extra.{k}"] = _full(state["extra"][k])
    return out


def v2_rank(rank: int, world: int, out_dir: str, name: str, version: int = 2) -> list[str]:
    """One rank of the version-2 (or 3: same state) save (run by ``shardpoint.testing.launch``)."""
    import torch.distributed as dist

    import shardpoint as sp

    ckpt = Path(out_dir) / name
    if rank == 0 and ckpt.exists():
        shutil.rmtree(ckpt)
    dist.barrier()
    plain = PLAIN_V2 if version == 2 else PLAIN_V3
    state = build_state_v2(world, plain)
    ids = V2_IDS if version == 2 else V3_IDS
    with mock.patch("uuid.uuid4", return_value=ids[rank]), mock.patch("time.time", return_value=CREATED):
        sp.save(str(ckpt), state)
    tensors = expected_tensors_v2(state)
    if rank == 0:
        m = sp.read_manifest(str(ckpt), chunks=False)
        assert m.format_version == sp.FORMAT_VERSION, m.format_version
        holders = sorted(k for k, t in m.tensors.items() if t.holders is not None)
        assert holders == sorted(V2_HOLDERS), holders
        doc = expected_json(state)
        doc.update(format_version=m.format_version, plain=plain, tensor_names=sorted(tensors), holders=holders)
        save_file(tensors, str(Path(out_dir) / f"{name}_expected.safetensors"))
        with open(Path(out_dir) / f"{name}_expected.json", "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")
    return sorted(tensors)


def write_v2(out_dir: Path, name: str = "v2", version: int = 2) -> Path:
    """Save the version-2 (or 3) golden checkpoint from 2 gloo ranks into ``out_dir/name`` plus the expected files."""
    from shardpoint.testing import launch

    root = str(HERE.parent.parent)  # the ranks import this module as tests.golden.make_golden
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))
    with mock.patch.dict(os.environ, {"PYTHONPATH": path}):
        launch(V2_WORLD, "tests.golden.make_golden:v2_rank", {"out_dir": str(out_dir), "name": name, "version": version}, timeout=240)
    return out_dir / name


def main() -> None:
    import shardpoint as sp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", type=int, choices=(1, 2, 3), default=3)
    args = ap.parse_args()
    if args.version != sp.FORMAT_VERSION:
        sys.exit(
            f"refusing: shardpoint now writes format version {sp.FORMAT_VERSION}, so tests/golden/v{args.version} "
            "can only be written by the shardpoint release that wrote that version"
        )
    ckpt = write(HERE) if args.version == 1 else write_v2(HERE, f"v{args.version}", args.version)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    print(f"wrote {ckpt} ({total} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
