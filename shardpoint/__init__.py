"""shardpoint: sharded checkpoints for PyTorch training at any parallel layout.

Save from any layout (single process, DDP, FSDP2/HSDP, DTensor TP, 2-D) and
load into any other; the checkpoint records logical tensors and where each
saved chunk sits, and loading reshards by geometry.

Example::

    import shardpoint as sp
    state = {"model": model, "optimizer": optimizer, "extra": {"step": 100}}
    sp.save("ckpt/step_100", state)
    sp.load("ckpt/step_100", state)

Every call is a collective over the default process group (or the
``process_group`` given), checked on entry so that ranks in different calls
raise :class:`DistributedError` instead of hanging; ``process_group=sp.LOCAL``
runs a save or load on the calling rank alone.
"""

from .api import CommitPolicy, LoadResult, SaveResult, load, read_manifest, read_tensor, save
from .saving.handle import AsyncSaveHandle
from .saving.async_save import AsyncSaver, Prewarmed, async_save, default_saver
from .dist import LOCAL
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    MissingBaseError,
    UnsafeCheckpointError,
    DistributedError,
    DtypeMismatchError,
    FormatError,
    IncompleteCheckpointError,
    IncompleteStateError,
    KeyMismatchError,
    MissingDependencyError,
    ReplicaMismatchError,
    ExpertLayoutError,
    ShapeMismatchError,
    StateNotRestoredError,
    StorageError,
    TornSnapshotError,
    GraphCaptureError,
    UnsupportedStateError,
    deprecated_error,
)
from .format.manifest import FORMAT_VERSION
from .training.data import ResumableLoader, ResumableSampler
from .adapters.experts import Experts
from .layouts import Fused, Padded, Reduced
from .manager import CheckpointManager, EveryNSteps, EveryTSeconds, OnDemand
from .peer import PeerMemory
from .training.rng import RNGState
from .storage import LocalStorage, MemoryStorage, Storage
from .storage.tiers import TieredStorage
from .convert.consolidate import consolidate, references_outside

__version__ = "0.1.0"
"""The package version; ``pyproject.toml`` reads it from here, so it is written in one place."""

__all__ = [
    "save",
    "async_save",
    "AsyncSaver",
    "AsyncSaveHandle",
    "Prewarmed",
    "default_saver",
    "load",
    "LOCAL",
    "read_manifest",
    "read_tensor",
    "SaveResult",
    "LoadResult",
    "CommitPolicy",
    "ConcurrentSaveError",
    "Storage",
    "LocalStorage",
    "MemoryStorage",
    "TieredStorage",
    "PeerMemory",
    "FORMAT_VERSION",
    "Fused",
    "Padded",
    "Reduced",
    "Experts",
    "CheckpointManager",
    "EveryNSteps",
    "EveryTSeconds",
    "OnDemand",
    "CheckpointTimeoutError",
    "ResumableSampler",
    "ResumableLoader",
    "RNGState",
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "MissingBaseError",
    "consolidate",
    "references_outside",
    "UnsafeCheckpointError",
    "FormatError",
    "KeyMismatchError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "StorageError",
    "UnsupportedStateError",
    "TornSnapshotError",
    "GraphCaptureError",
    "DistributedError",
    "MissingDependencyError",
    "StateNotRestoredError",
    "IncompleteStateError",
    "ReplicaMismatchError",
    "ExpertLayoutError",
]


def __getattr__(name: str):
    # Deprecated names (CheckpointConflictError) still import, with a DeprecationWarning.
    try:
        return deprecated_error(name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
