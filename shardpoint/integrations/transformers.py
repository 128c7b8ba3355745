"""Checkpoint a Hugging Face ``transformers.Trainer`` run with shardpoint.

:class:`ShardpointTrainer` is a drop-in ``Trainer`` whose checkpoints
(``<output_dir>/checkpoint-<step>``) hold the model, optimizer, learning-rate
scheduler, gradient scaler and every process's random generators as one
shardpoint checkpoint: each process writes its own share, checksums are
verified on load, and a checkpoint resumes at another number of processes.
Everything else stays Trainer's: ``trainer_state.json`` is written beside it
(so best-model tracking, callbacks' state and logs carry on),
``save_total_limit`` removes old checkpoints, and
``train(resume_from_checkpoint=...)`` takes a folder or ``True`` for the
newest. The model is also written in Hugging Face format (safetensors and
``config.json``) when ``save_hf_model=True``; ``trainer.save_model()`` is
unchanged. A folder Trainer itself wrote still resumes (through Trainer's
own loading).

Example::

    from shardpoint.integrations.transformers import ShardpointTrainer

    trainer = ShardpointTrainer(model=model, args=args, train_dataset=data)
    trainer.train()                              # saves checkpoint-<step> folders
    trainer.train(resume_from_checkpoint=True)   # continues from the newest
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..api import load, read_manifest, save
from ..errors import CheckpointError, UnsupportedStateError
from ..runtime.extras import require
from ..format.manifest import MANIFEST_NAME
from ..training.rng import RNGState
from .common import top_level_keys

require("transformers", "transformers", "shardpoint.integrations.transformers")
from transformers import Trainer  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME  # noqa: E402

__all__ = ["ShardpointTrainer", "latest_checkpoint", "is_shardpoint_checkpoint"]

log = logging.getLogger(__name__)

_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_HF_WEIGHTS = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)


def is_shardpoint_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds a committed shardpoint checkpoint (its manifest).

    Example::

        is_shardpoint_checkpoint("out/checkpoint-500")  # True for ShardpointTrainer's folders
    """
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def _resumable(folder: str) -> bool:
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)):
        return False  # the trainer state is written last: the save did not finish
    if is_shardpoint_checkpoint(folder):
        try:
            read_manifest(folder, chunks=False)
            return True
        except CheckpointError as e:
            log.warning("skipping %s: %s", folder, e)
            return False
    return any(os.path.isfile(os.path.join(folder, name)) for name in _HF_WEIGHTS)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-<step>`` folder under ``output_dir`` that a run can resume from, or ``None``.

    A folder counts when its save finished: it holds ``trainer_state.json``
    and a committed shardpoint checkpoint (or Trainer's own model files). A
    newer folder whose save was interrupted is skipped, so a run killed
    mid-save resumes from the checkpoint before.

    Example::

        trainer.train(resume_from_checkpoint=latest_checkpoint("out"))
    """
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(((int(m.group(1)), n) for n in os.listdir(output_dir) if (m := _FOLDER.match(n))), reverse=True)
    for _, name in steps:
        folder = os.path.join(output_dir, name)
        if os.path.isdir(folder) and _resumable(folder):
            return folder
    return None


def _selected(folder: str, *keys: str) -> list[str]:
    """``keys=`` patterns for the entries ``keys`` of the checkpoint in ``folder``.

    ``load`` refuses a pattern that selects nothing, so ``k.*`` is asked for
    only where the checkpoint has names under ``k``; the bare ``k`` (one value,
    or anything under it) still makes an entry the checkpoint lacks raise
    :class:`~shardpoint.KeyMismatchError`.
    """
    manifest = read_manifest(folder, chunks=False)
    names = [*manifest.tensors, *manifest.values]
    return [p for k in keys for p in ([k, f"{k}.*"] if any(n.startswith(f"{k}.") for n in names) else [k])]


class ShardpointTrainer(Trainer):
    """A ``transformers.Trainer`` that saves and resumes its checkpoints with shardpoint.

    Takes Trainer's arguments, plus ``save_hf_model``: also write each
    checkpoint's model in Hugging Face format (``model.safetensors`` and
    ``config.json``, loadable with ``from_pretrained``). Each
    ``checkpoint-<step>`` holds one shardpoint checkpoint with the entries
    ``model``, ``optimizer``, ``scheduler``, ``scaler`` (with mixed precision
    that uses one) and ``rng``, and Trainer's ``trainer_state.json``. With
    ``save_only_model=True`` only ``model`` is saved, as with Trainer.
    Resuming restores all of it, the learning-rate schedule included; a
    checkpoint that lacks an entry the run has raises
    :class:`~shardpoint.KeyMismatchError` instead of restarting it.
    DeepSpeed runs keep their state in DeepSpeed's engine and are refused.

    Example::

        trainer = ShardpointTrainer(model=model, args=TrainingArguments("out", save_steps=100), train_dataset=data)
        trainer.train(resume_from_checkpoint=True)
    """

    def __init__(self, *args: Any, save_hf_model: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise UnsupportedStateError(
                "ShardpointTrainer does not handle DeepSpeed: its engine owns the model and optimizer state; "
                "use transformers.Trainer's own checkpoints with DeepSpeed"
            )
        self.save_hf_model = save_hf_model
        self._saving_checkpoint = False

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: Any = None) -> Any:
        """Train as ``Trainer.train`` does; ``resume_from_checkpoint=True`` picks :func:`latest_checkpoint`.

        Example::

            trainer.train(resume_from_checkpoint=True)
        """
        if resume_from_checkpoint is True:
            found = latest_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = found
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    # Saving: Trainer's _save_checkpoint runs as usual (best-model bookkeeping, trainer_state.json,
    # rotation); its model, optimizer, scaler and RNG writers are replaced by one shardpoint save.

    def _checkpoint_state(self, with_training: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        if with_training:
            if self.optimizer is not None:
                # Accelerate's wrapper is an Optimizer only by inheritance; the real one is inside.
                state["optimizer"] = getattr(self.optimizer, "optimizer", self.optimizer)
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler
            if getattr(self.accelerator, "scaler", None) is not None:
                state["scaler"] = self.accelerator.scaler
            state["rng"] = RNGState()
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``; inside a checkpoint, the shardpoint save (and the HF files if asked).

        Example::

            trainer.save_model("final")  # Hugging Face format, as with Trainer
        """
        if not self._saving_checkpoint:
            return super().save_model(output_dir, _internal_call)
        save(output_dir, self._checkpoint_state(with_training=not self.args.save_only_model))
        if self.save_hf_model:
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._saving_checkpoint:
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if not self._saving_checkpoint:
            super()._save_scaler(output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._saving_checkpoint:
            super()._save_rng_state(output_dir)

    # Loading: Trainer calls these at the moments it restores each part (the model before or after
    # wrapping, the generators after skipping the batches already seen); each reads only its part.

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ours(resume_from_checkpoint, model_files_fallback=True):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load(resume_from_checkpoint, {"model": self.model if model is None else model}, keys=_selected(resume_from_checkpoint, "model"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" not in top_level_keys(read_manifest(checkpoint, chunks=False)):
            log.warning("%s holds no optimizer state (saved with save_only_model=True): the optimizer starts fresh", checkpoint)
            return
        # The model is in the state only to name the optimizer's parameters; it is not read again.
        state = self._checkpoint_state(with_training=True)
        del state["rng"]
        load(checkpoint, state, keys=_selected(checkpoint, *(k for k in state if k != "model")))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._ours(checkpoint):
            super()._load_scaler(checkpoint)  # ours: restored with the optimizer

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        if "rng" not in top_level_keys(read_manifest(checkpoint, chunks=False)):
            log.info("%s holds no generator state: reproducibility of the resumed run is not guaranteed", checkpoint)
            return
        load(checkpoint, {"rng": RNGState()}, keys=_selected(checkpoint, "rng"))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not self._ours(best):
            return super()._load_best_model()
        log.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        load(best, {"model": self.model}, keys=_selected(best, "model"))

    @staticmethod
    def _ours(folder: str, model_files_fallback: bool = False) -> bool:
        """A shardpoint checkpoint; with ``model_files_fallback``, also a shardpoint save that never committed.

        The fallback sends such a folder (shardpoint's ``data`` and none of
        Trainer's model files) to shardpoint's load, which names the problem.
        """
        if is_shardpoint_checkpoint(folder):
            return True
        if not model_files_fallback or not os.path.isdir(os.path.join(folder, "data")):
            return False
        return not any(os.path.isfile(os.path.join(folder, n)) for n in _HF_WEIGHTS)
