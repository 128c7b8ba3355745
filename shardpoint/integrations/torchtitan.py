"""A torchtitan checkpoint manager backed by shardpoint, and import of torchtitan's DCP checkpoints.

torchtitan 0.3.0 makes its checkpointer pluggable: ``Trainer.Config.checkpoint``
is any ``BaseCheckpointManager.Config``, and the trainer builds the manager
from it with the dataloader, model parts, optimizers, schedulers and its own
train state. :class:`ShardpointCheckpointManager` is such a manager. It keeps
torchtitan's policies (``interval``, ``keep_latest_k``, ``load_step``,
``initial_load_path``, ``exclude_from_loading``, ``last_save_model_only`` with
``export_dtype``, a model-only step-0 seed checkpoint) and its layout
(``<dump_folder>/<folder>/step-<N>``), and writes each step as a shardpoint
checkpoint: every rank writes its own shards, checksums are verified on load,
and loading reshards to the current parallelism.

The checkpoint holds ``model`` (torchtitan's ``ModelWrapper`` state, so the
model's own state-dict hooks run both ways), ``optimizer``, ``lr_scheduler``,
``dataloader`` (``None`` when there is none) and the trainer's ``train_state``.

Example (in a torchtitan config)::

    from shardpoint.integrations.torchtitan import ShardpointCheckpointManager

    config.checkpoint = ShardpointCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

:func:`import_dcp` converts a checkpoint written by torchtitan's own (DCP)
``CheckpointManager`` into this layout, so a run can switch over and resume.
Hugging Face safetensors loads and saves (``initial_load_in_hf``,
``last_save_in_hf``) stay with torchtitan's DCP manager and are refused here.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
import time
from dataclasses import dataclass
from typing import Any

from ..api import load, save
from ..saving.handle import AsyncSaveHandle
from ..saving.async_save import AsyncSaver
from ..convert.dcp import import_dcp as _convert_dcp
from ..errors import CheckpointNotFoundError, UnsupportedStateError
from ..format.manifest import MANIFEST_NAME
from ..storage import storage_for
from ..runtime import torchcompat
from ..runtime.extras import require
from .common import remove_path

require("torchtitan", "", "shardpoint.integrations.torchtitan",
        "pip install --no-deps torchtitan, then its requirements (see the torchtitan integration guide)")
# On an older torch torchtitan itself fails to import; say which torch it needs instead.
torchcompat.require("torchtitan 0.3.0", torchcompat.torchtitan_runs(), "2.11")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.components.checkpointer import (  # noqa: E402
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

__all__ = ["ShardpointCheckpointManager", "import_dcp", "TORCHTITAN_KEYS"]

log = logging.getLogger("shardpoint")

_STEP = re.compile(r"step-(\d+)")

# The top-level state keys torchtitan's DCP manager writes besides the flattened model.
TORCHTITAN_KEYS = (OPTIMIZER, LR_SCHEDULER, DATALOADER, "train_state")

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ShardpointCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, writing and reading shardpoint checkpoints.

    Built by torchtitan's trainer from :class:`ShardpointCheckpointManager.Config`
    (``config.build(dataloader=..., model_parts=..., optimizers=..., ...)``);
    ``save(step)`` and ``load(step)`` are called by the training loop on every
    rank. With ``async_save=True`` a save returns once this rank's tensors are
    staged in host memory and is written and committed in the background;
    the next save, ``maybe_wait_for_saving`` and ``close`` wait for it.

    Example::

        manager = ShardpointCheckpointManager.Config(enable=True, interval=10).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder="outputs",
        )
        manager.load()          # the latest step in outputs/checkpoint, if any
        manager.save(curr_step=10)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint settings, plus shardpoint's own."""

        async_save: bool = False
        """Write checkpoints in the background after a short snapshot (shardpoint's ``AsyncSaver``)."""

        staging_bytes: int = 2 << 30
        """Host memory for asynchronous staging, per rank."""

        verify: bool = True
        """Verify every checksum on load."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise UnsupportedStateError(
                    "ShardpointCheckpointManager does not read or write Hugging Face safetensors; "
                    "use torchtitan's CheckpointManager for initial_load_in_hf/last_save_in_hf, or "
                    "`shardpoint export --to hf` on a saved step"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future = None
        self.folder = os.path.join(base_folder, config.folder) if "://" not in config.folder else config.folder
        self.states = states
        # As torchtitan's own manager: a missing dataloader is saved as None, so the keys always match.
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.export_dtype = _DTYPES[config.export_dtype]
        self._saver: AsyncSaver | None = AsyncSaver(staging_bytes=config.staging_bytes) if config.async_save else None
        self._pending: AsyncSaveHandle | None = None

    # ------------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def step_path(self, step: int) -> str:
        """Where step ``step`` is saved: ``<folder>/step-<step>``."""
        return f"{self.folder.rstrip('/')}/step-{step}"

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        path = self.step_path(curr_step)
        if last_step and self.config.last_save_model_only:
            # The final export: model weights only, in export_dtype; not meant for resuming.
            weights = {
                k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.states[MODEL].state_dict().items()
            }
            save(path, {MODEL: weights})
        elif self._saver is not None and not last_step:
            self._pending = self._saver.save(path, self.states)
            self.save_future = self._pending
        else:
            save(path, self.states)
        self._purge(keep=path)
        log.info("rank %s: checkpoint step %s %s in %.2fs", _rank(), curr_step,
                 "staged" if self._pending is not None else "saved", time.monotonic() - begin)
        return True

    def _purge(self, keep: str) -> None:
        k = self.config.keep_latest_k
        if k <= 0 or _rank() != 0:
            return
        steps = sorted(self._steps(committed_only=False))
        for step in steps[:-k]:
            path = self.step_path(step)
            if path != keep:
                remove_path(path)

    def _wait_for_saving(self) -> None:
        pending, self._pending, self.save_future = self._pending, None, None
        if pending is not None:
            pending.wait()

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an asynchronous save returns only once its snapshot is staged."""

    def _close(self) -> None:
        self.maybe_wait_for_saving()

    # ------------------------------------------------------------------ load
    def _steps(self, committed_only: bool = True) -> list[int]:
        """The steps saved under the folder; with ``committed_only``, only those whose save was committed."""
        storage = storage_for(self.folder)
        found = set()
        for name in storage.list():
            top, _, rest = name.partition("/")
            m = _STEP.fullmatch(top)
            if m and (rest == MANIFEST_NAME or not committed_only):
                found.add(int(m.group(1)))
        return sorted(found)

    def _load(self, step: int = -1) -> bool:
        steps = self._steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: no committed checkpoint at {self.step_path(step)} "
                f"(committed steps: {steps or 'none'})"
            )
        if steps:
            step = steps[-1] if step == -1 else step
            path, model_only = self.step_path(step), step == 0
        elif self.config.initial_load_path:
            path, model_only = self.config.initial_load_path, self.config.initial_load_model_only
        else:
            log.info("rank %s: no checkpoint in %s; a fresh start", _rank(), self.folder)
            return False
        begin = time.monotonic()
        for key in self.config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"exclude_from_loading: {key!r} is not a state key ({sorted(self.states)})")
        if model_only:
            state = {MODEL: self.states[MODEL]}
            load(path, state, keys=[f"{MODEL}.*"], verify=self.config.verify)
        else:
            state = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
            excluded = [f"{k}*" for k in self.config.exclude_from_loading]
            load(path, state, verify=self.config.verify,
                 **({"keys": [f"{k}*" for k in state]} if excluded else {}))
        log.info("rank %s: loaded %s in %.2fs", _rank(), path, time.monotonic() - begin)
        return True


def import_dcp(
    src: str, dst: str, *, allow_pickle: bool = False, trust_pickle: bool | None = None, force: bool = False, quiet: bool = True
) -> Any:
    """Convert a checkpoint step written by torchtitan's DCP ``CheckpointManager`` into shardpoint's layout.

    torchtitan's DCP checkpoints keep the model's tensors at the top level
    (``layers.0.attention.wq.weight``) beside ``optimizer.*``,
    ``lr_scheduler``, ``dataloader`` and ``train_state``; the model's names
    move under ``model.``, the rest keep theirs, and the sharding of every
    saved chunk is kept. DCP's metadata and plain objects are pickles, and
    unpickling runs code chosen by whoever wrote them: pass
    ``allow_pickle=True`` only for checkpoints you trust (without it a
    ``ConversionError`` is raised; ``trust_pickle`` is its deprecated old
    name). Returns shardpoint's import report.

    Example::

        import_dcp("outputs/checkpoint/step-1000", "outputs/sp_checkpoint/step-1000", allow_pickle=True)
        # then resume with ShardpointCheckpointManager.Config(folder="sp_checkpoint", ...)
    """
    others = "|".join(re.escape(k) for k in (MODEL, *TORCHTITAN_KEYS))
    if trust_pickle is not None:
        warnings.warn("trust_pickle= is deprecated; use allow_pickle=", DeprecationWarning, stacklevel=2)
        allow_pickle = allow_pickle or bool(trust_pickle)
    return _convert_dcp(src, dst, allow_pickle=allow_pickle, rename=[f"^(?!(?:{others})(?:\\.|$))=model."], force=force, quiet=quiet)
