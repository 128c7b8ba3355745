"""Conversions between shardpoint checkpoints and other formats, and offline tools.

Each converter streams: tensors (or chunks) are read, converted and written
one at a time, so peak memory stays near the largest tensor, never the model.

=====================================  ==========================================
:func:`export_hf` / :func:`import_hf`  Hugging Face safetensors (+ index json)
:func:`export_dcp` / :func:`import_dcp`  PyTorch DCP folders (import needs trust)
:func:`export_torch` / :func:`import_torch`  ``torch.save`` files (import needs trust)
:func:`reshard`                        a copy pre-sharded for a target layout
:func:`diff`                           tensor-by-tensor comparison
:func:`plot_shard_map`                 a picture of how tensors are split
:func:`verify_checkpoint`              every chunk checked against its checksums
=====================================  ==========================================

The ``shardpoint`` command (:mod:`shardpoint.cli`) exposes all of them.

Example::

    from shardpoint.convert import export_hf, import_hf
    export_hf("ckpt/step_100", "hf_out", dtype=torch.bfloat16, config="config.json")
    import_hf("hf_out", "ckpt/restart")
"""

from ..errors import ConversionError
from .common import CheckpointReader, CheckpointWriter
from .options import NameMap
from .dcp import export_dcp, import_dcp
from .diff import DiffResult, TensorDiff, diff
from .hf import HFExportResult, ImportResult, export_hf, import_hf
from .reshard import ReshardResult, TargetLayout, parse_layout, reshard
from .shardmap import chunk_table, plot_shard_map
from .torchfile import export_torch, import_torch
from .verify import verify_checkpoint


def import_deepspeed(*args, **kwargs):
    """See :func:`shardpoint.convert.deepspeed_native.import_deepspeed` (imported lazily)."""
    from .deepspeed_native import import_deepspeed as _impl

    return _impl(*args, **kwargs)


__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "ConversionError",
    "NameMap",
    "export_hf",
    "import_hf",
    "export_dcp",
    "import_dcp",
    "export_torch",
    "import_torch",
    "import_deepspeed",
    "reshard",
    "parse_layout",
    "TargetLayout",
    "diff",
    "DiffResult",
    "TensorDiff",
    "chunk_table",
    "plot_shard_map",
    "verify_checkpoint",
    "HFExportResult",
    "ImportResult",
    "ReshardResult",
]
