"""One error tree for everything shardpoint raises.

Every error derives from :class:`CheckpointError` (itself an ``Exception``), so
``except sp.CheckpointError`` catches anything the library reports on purpose.
Messages name the checkpoint, the tensor and, where it helps, what to do.
"""

from __future__ import annotations

import errno
import warnings
from typing import Mapping

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "MissingBaseError",
    "BaseLocationError",
    "FormatError",
    "KeyMismatchError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "mismatch_error",
    "UnsupportedStateError",
    "StorageError",
    "DistributedError",
    "CheckpointTimeoutError",
    "MissingDependencyError",
    "StateNotRestoredError",
    "IncompleteStateError",
    "ConcurrentSaveError",
    "ConversionError",
    "TornSnapshotError",
    "GraphCaptureError",
    "deprecated_error",


    "ReplicaMismatchError",
    "ExpertLayoutError",
]


class CheckpointError(Exception):
    """Base class of every error shardpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No shardpoint checkpoint at the path: it does not exist, or it holds something else.

    The message says what the path holds instead (a manager's run folder and
    its steps, a ``torch.save`` file, another tool's folder) and how to load it.
    Also a ``FileNotFoundError`` (so an ``OSError``), as frameworks' checkpoint
    hooks and user code expect of a missing checkpoint::

        try:
            sp.load("ckpt/missing", state)
        except FileNotFoundError:
            start_fresh()
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.errno = errno.ENOENT  # what code that inspects an OSError's errno expects of a missing path


class IncompleteCheckpointError(CheckpointError):
    """The path holds a shardpoint save's files but no committed manifest (a crashed or running save), or nothing at all."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match their recorded checksum or size."""


class MissingBaseError(CheckpointError):
    """An incremental checkpoint references data of another checkpoint (its base) that is gone.

    ``base`` is the missing location as the checkpoint names it (relative,
    e.g. ``../step_100``) and ``url`` where that resolves. Raised before any
    byte is loaded. Example::

        try:
            sp.load("ckpt/step_200", state)
        except sp.MissingBaseError as e:
            print("restore", e.url)
    """

    def __init__(self, message: str, base: str = "", url: str = ""):
        super().__init__(message)
        self.base, self.url = base, url


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
    """A tensor's global shape (or dtype) differs between checkpoint and target.

    Example::

        try:
            sp.load("ckpt/step_100", {"model": model})
        except sp.ShapeMismatchError as e:
            print(e)  # names the tensor, the saved and the target shape
    """


class DtypeMismatchError(ShapeMismatchError):
    """A tensor has the same shape in checkpoint and target, but another dtype.

    Loading never casts: create the target in the saved dtype, load, then
    cast (``model.to(torch.bfloat16)``). It is a :class:`ShapeMismatchError`,
    so code that already catches that one keeps working.

    Example::

        try:
            sp.load("ckpt/step_100", {"model": model.bfloat16()})
        except sp.DtypeMismatchError as e:
            print(e)  # "... checkpoint has float32[4, 4], target has bfloat16[4, 4] ..."
    """


def mismatch_error(where: str, fqn: str, saved: tuple[str, list], target: tuple[str, list]) -> ShapeMismatchError:
    """The error for a tensor whose saved (dtype, shape) differs from the target's.

    A :class:`DtypeMismatchError` when only the dtype differs, else a
    :class:`ShapeMismatchError`; the message names both sides.

    Example::

        raise mismatch_error("ckpt", "model.w", ("float32", [4]), ("bfloat16", [4]))
    """
    (sd, ss), (td, ts) = saved, target
    msg = f"{where}: tensor {fqn!r}: checkpoint has {sd}{list(ss)}, target has {td}{list(ts)}"
    if list(ss) == list(ts):
        return DtypeMismatchError(
            msg + f"; loading does not cast: load into a {sd} tensor, then cast it to {td}"
        )
    return ShapeMismatchError(msg)


class UnsupportedStateError(CheckpointError):
    """A state object or value that no adapter or codec knows how to handle."""


class BaseLocationError(UnsupportedStateError):
    """The ``base=`` of an incremental save cannot be referenced from where the new checkpoint is saved.

    A reference is a location relative to the new checkpoint, so the base
    must lie on the same storage, in the same tree (a sibling folder of one
    run, on the same filesystem, bucket, ``MemoryStorage`` or
    ``TieredStorage``). The message says which rule failed and what to give
    instead. Raised before anything is written. Example::

        try:
            sp.save("ckpt/step_200", state, base="s3://bucket/step_100")
        except BaseLocationError as e:
            print(e)   # ... lies on another storage ...
    """


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


class _ConflictBase(CheckpointError):
    """Deprecated: use :class:`ConcurrentSaveError`, which every concurrent save raises.

    ``CheckpointConflictError`` was the manager's error for two saves racing
    to one step folder. It is kept for one release as a base class of
    :class:`ConcurrentSaveError`, so ``except CheckpointConflictError``
    still catches every concurrent save; reading the name warns.
    """


_ConflictBase.__name__ = _ConflictBase.__qualname__ = "CheckpointConflictError"


class ConcurrentSaveError(_ConflictBase):
    """Another save is writing the same checkpoint path or step, so this one stopped without committing.

    Saves claim their path before writing (see :class:`shardpoint.CommitPolicy`):
    the second of two overlapping saves to one path raises this error, and a
    save whose claim was taken over after its lease ran out raises it before
    its commit. Whatever the path held stays loadable. ``path`` names the
    checkpoint and ``holder`` describes the other save (host, process, since when).
    The :class:`~shardpoint.CheckpointManager` raises it too when two saves
    race to one step folder (its step lock is held).

    It replaces ``CheckpointConflictError`` (deprecated, removed in the next
    release): that name still imports, with a ``DeprecationWarning``, and is
    a base class of this one, so ``except CheckpointConflictError`` clauses
    keep catching every concurrent save.

    Example::

        try:
            mgr.save(step, state)
        except sp.ConcurrentSaveError as e:
            print(e.path, e.holder)
    """

    def __init__(self, message: str, path: str = "", holder: str = ""):
        super().__init__(message)
        self.path, self.holder = path, holder


class ConversionError(CheckpointError):
    """A conversion cannot proceed: bad arguments, an unsupported input, an unsafe output."""


class TornSnapshotError(CheckpointError):
    """An asynchronous save's state changed in place before its snapshot was complete.

    Raised by :meth:`~shardpoint.AsyncSaveHandle.wait` (the same error on
    every rank). In lazy mode, parameters and optimizer state are copied in
    the background until the fence: ``handle.fence()``, the next
    ``optimizer.step()`` (its pre-hook fences), or ``handle.done()`` and
    ``handle.wait()``. Changing one of them in place before the fence (an
    EMA, a clamp, manual weight decay, touching optimizer moments) is such a
    change. Nothing was committed and the previous checkpoint at the path is
    intact. Fix: call ``handle.fence()`` before changing state outside
    ``optimizer.step()``, or save with ``mode="eager"``. ``tensors`` lists
    the names that changed.

    Example::

        h = sp.async_save("ckpt/step_10", state, mode="lazy")
        h.fence()            # before any change outside optimizer.step()
        ema.update(model)
    """

    def __init__(self, message: str, tensors: list[str] | None = None):
        super().__init__(message)
        self.tensors = list(tensors or [])


_DEPRECATED = {"CheckpointConflictError": (_ConflictBase, "ConcurrentSaveError")}


def deprecated_error(name: str) -> type:
    """A deprecated error class by its old name, with a ``DeprecationWarning`` naming the new one.

    Raises ``AttributeError`` for any other name (modules use it in ``__getattr__``).

    Example::

        deprecated_error("CheckpointConflictError")  # warns; a base of ConcurrentSaveError
    """
    if name not in _DEPRECATED:
        raise AttributeError(name)
    cls, new = _DEPRECATED[name]
    warnings.warn(f"shardpoint.{name} is deprecated; catch shardpoint.{new} instead", DeprecationWarning, stacklevel=3)
    return cls


def __getattr__(name: str):
    try:
        return deprecated_error(name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


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


class GraphCaptureError(CheckpointError):
    """A save was called while the calling thread captures a graph on its accelerator.

    A save's copies and waits cannot be recorded into a graph: they would
    run at each replay, or fail the capture. Nothing was written. Fix: call
    the save outside the captured region (between replays of the graph).

    Example::

        g.replay()
        sp.async_save("ckpt/step_10", state)   # not inside the capture
    """
