"""One error tree for everything shardpoint raises.

Every error derives from :class:`CheckpointError` (itself an ``Exception``), so
``except sp.CheckpointError`` catches anything the library reports on purpose.
Messages name the checkpoint, the tensor and, where it helps, what to do.
"""

from __future__ import annotations

from typing import Mapping

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "FormatError",
    "KeyMismatchError",
    "ShapeMismatchError",
    "UnsupportedStateError",
    "StorageError",
    "DistributedError",
    "CheckpointTimeoutError",
    "CheckpointConflictError",
    "MissingDependencyError",
    "StateNotRestoredError",
    "IncompleteStateError",
    "ConcurrentSaveError",
    "ConversionError",
    "ReplicaMismatchError",
    "ExpertLayoutError",
]


class CheckpointError(Exception):
    """Base class of every error shardpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint path does not exist at all."""


class IncompleteCheckpointError(CheckpointError):
    """The path exists but holds no committed manifest (a crashed or running save)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match their recorded checksum or size."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file is not a plain file inside the checkpoint.

    Raised before anything is read from it: a symbolic link (to anywhere), a
    FIFO, a device, a directory where a file belongs, or a metadata file larger
    than the format's limit. The message names the file.
    """


class FormatError(CheckpointError):
    """The manifest is malformed, from an unknown format version, or unsafe."""


class KeyMismatchError(CheckpointError):
    """Keys are missing from, or unexpected in, the checkpoint under ``strict=True``."""

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None):
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])


class ShapeMismatchError(CheckpointError):
    """A tensor's global shape or dtype differs between checkpoint and target."""


class UnsupportedStateError(CheckpointError):
    """A state object or value that no adapter or codec knows how to handle."""


class StorageError(CheckpointError):
    """A storage backend failed (after its own retries)."""


class DistributedError(CheckpointError):
    """One or more ranks failed during a collective operation.

    Raised identically on every rank. ``causes`` maps each failing rank to a
    short description of its exception; ``first`` is the most specific
    shardpoint error class seen, so callers can still branch on it.
    """

    def __init__(self, message: str, causes: Mapping[int, str], first: type | None = None):
        super().__init__(message)
        self.causes = dict(causes)
        self.first = first


class CheckpointTimeoutError(CheckpointError):
    """A save, restore or manager collective did not finish within the configured timeout.

    ``rank``, ``phase`` (e.g. ``"write"``, ``"commit"``, ``"decide"``,
    ``"restore"``), ``step`` and ``seconds`` say where it stalled.
    """

    def __init__(self, message: str, rank: int = -1, phase: str = "", step: int | None = None, seconds: float = 0.0):
        super().__init__(message)
        self.rank, self.phase, self.step, self.seconds = rank, phase, step, seconds


class CheckpointConflictError(CheckpointError):
    """Another save holds the step folder's lock: two saves raced to the same step."""


class MissingDependencyError(CheckpointError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra to install.

    The core (save, load, the manager, local and in-memory storage) needs none
    of them; the CLI's tables and progress bars, Hugging Face import, S3 and
    plots each come with an extra such as ``pip install 'shardpoint[cli]'``.
    It is also an ``ImportError``, so code that already guards an optional
    import keeps working. ``package`` names the missing distribution and
    ``hint`` the command that installs it, where the raiser gives them.
    """

    def __init__(self, message: str, package: str = "", hint: str = ""):
        super().__init__(message)
        self.package, self.hint = package, hint


class StateNotRestoredError(CheckpointError):
    """A load wrote tensors that did not reach the live training state.

    Raised by a strict load after its landing check: every tensor read from
    the checkpoint must be live state (a parameter, buffer or optimizer state
    tensor the load filled in place) or have reached live state through the
    object's own ``load_state_dict``. ``entries`` names those that did not,
    on the rank that raised it.
    """

    def __init__(self, message: str, entries: list[str] | None = None):
        super().__init__(message)
        self.entries = list(entries or [])


class IncompleteStateError(CheckpointError):
    """A save was handed an object whose state is certainly incomplete.

    For example a module with parameters whose ``state_dict()`` is empty, or an
    optimizer that keeps its real state in inner optimizers while its own
    ``.state`` is empty. Saving it would produce a checkpoint that cannot
    restore training.
    """


class ConcurrentSaveError(CheckpointError):
    """Another save is writing the same checkpoint path, so this one stopped without committing.

    Saves claim their path before writing (see :class:`shardpoint.CommitPolicy`):
    the second of two overlapping saves to one path raises this error, and a
    save whose claim was taken over after its lease ran out raises it before
    its commit. Whatever the path held stays loadable. ``path`` names the
    checkpoint and ``holder`` describes the other save (host, process, since when).
    """

    def __init__(self, message: str, path: str = "", holder: str = ""):
        super().__init__(message)
        self.path, self.holder = path, holder


class ConversionError(CheckpointError):
    """A conversion cannot proceed: bad arguments, an unsupported input, an unsafe output."""


class ReplicaMismatchError(CheckpointError):
    """Ranks that are to hold the same copy of a tensor hold different values; the save stopped.

    A plain (non-DTensor) tensor is taken to be the same on every rank of its
    replica group (every rank, unless ``replicated_over`` says otherwise), and
    only one copy is written. Before anything is written the ranks compare a
    digest of their copies; when they differ, saving one copy would lose the
    others' values, so every rank raises this error and the path keeps what
    it held. ``tensor`` names the tensor and ``groups`` lists the ranks that
    agree with each other (one list per distinct value).

    Example::

        try:
            sp.save(path, state)
        except sp.ReplicaMismatchError as e:
            print(e.tensor, e.groups)  # declare replicated_over={"model.experts.*": group}
    """

    def __init__(self, message: str, tensor: str = "", groups: list | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.groups = [list(g) for g in (groups or [])]


class ExpertLayoutError(CheckpointError):
    """An expert-parallel layout that cannot hold the experts: the EP degree does not divide their number.

    Raised at save and at load, naming the number of experts and the EP degree.

    Example::

        sp.Experts("model.experts", num_experts=6, group=ep_group)  # EP 4: raises at save
    """
