"""Save and load an Accelerate ``Accelerator``'s state with shardpoint.

:func:`save_state` and :func:`load_state` are the shardpoint counterparts of
``Accelerator.save_state`` / ``Accelerator.load_state``, with the same
arguments and the same project behaviour. They cover what the accelerator
tracks: every prepared model, optimizer and scheduler, the objects
registered with ``register_for_checkpointing``, the gradient scaler, the
gradient-accumulation ``step`` and each process's random generators
(:class:`shardpoint.RNGState`). Every process calls them (they are
collectives, as Accelerate's own are); each process writes only its share
of the tensors, and checksums are verified on load.

As with Accelerate:

* hooks registered with ``accelerator.register_save_state_pre_hook`` run
  before the save as ``hook(models, weights, output_dir)``, and those of
  ``register_load_state_pre_hook`` before the load as ``hook(models,
  input_dir)``; a model whose weights (or whose entry in ``models``) a hook
  removes is left to the hook;
* with ``ProjectConfiguration(automatic_checkpoint_naming=True)`` a save
  with no folder goes to ``<project_dir>/checkpoints/checkpoint_<iteration>``,
  only the newest ``total_limit`` of those folders are kept, and a load
  with no folder restores the newest one;
* every save advances ``accelerator.project_configuration.iteration``.

What is not included: the position in the dataloaders (use
``accelerator.skip_first_batches`` or a :class:`shardpoint.ResumableLoader`
and add it to the state with ``extra``). DeepSpeed and Megatron-LM
accelerators keep their state in their own engines and are refused.

Example::

    from accelerate import Accelerator
    from shardpoint.integrations.accelerate import load_state, save_state

    accelerator = Accelerator()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    save_state(accelerator, "ckpt/step_100")
    ...
    load_state(accelerator, "ckpt/step_100")
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping, Sequence

import torch

from ..api import LoadResult, SaveResult, load, read_manifest, save
from ..errors import CheckpointError, CheckpointNotFoundError, UnsupportedStateError
from ..dist import Comm
from ..runtime.extras import require
from ..training.rng import RNGState
from .common import remove_path

require("accelerate", "accelerate", "shardpoint.integrations.accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["accelerator_state", "save_state", "load_state", "checkpoint_folders"]

log = logging.getLogger(__name__)

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
_FOLDER = re.compile(r"^checkpoint_(\d+)$")


class _Step:
    """The accelerator's gradient-accumulation step counter, as a ``Stateful``."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def accelerator_state(
    accelerator: Accelerator, extra: Mapping[str, Any] | None = None, *, models: Sequence[Any] | None = None
) -> dict[str, Any]:
    """The shardpoint state for everything ``accelerator`` tracks, plus ``extra``.

    Keys: ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>`` and ``custom_<i>``
    in the order Accelerate holds them (the order of ``prepare`` and
    ``register_for_checkpointing`` calls), ``scaler`` when mixed precision
    uses one, ``step`` and ``rng``. ``models`` replaces the prepared models
    (what the state-hooks left: modules or state dicts), numbered in order.
    Pass the same ``extra`` keys to save and load.

    Example::

        state = accelerator_state(accelerator, extra={"data": loader})
        sp.save("ckpt/step_100", state)
    """
    if accelerator.distributed_type in _UNSUPPORTED:
        raise UnsupportedStateError(
            f"shardpoint.integrations.accelerate does not handle {accelerator.distributed_type.value}: "
            "its engine owns the model and optimizer state; use accelerator.save_state instead"
        )
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models if models is None else models):
        state[f"model_{i}"] = model
    for i, opt in enumerate(accelerator._optimizers):
        # AcceleratedOptimizer is an Optimizer only by inheritance; the real one is inside.
        state[f"optimizer_{i}"] = getattr(opt, "optimizer", opt)
    for i, sched in enumerate(accelerator._schedulers):
        state[f"scheduler_{i}"] = sched
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["step"] = _Step(accelerator)
    state["rng"] = RNGState()
    for k, v in (extra or {}).items():
        if k in state:
            raise ValueError(f"extra key {k!r} collides with the accelerator's own state key")
        state[k] = v
    return state


def checkpoint_folders(accelerator: Accelerator) -> list[str]:
    """The ``checkpoint_<n>`` folders under ``<project_dir>/checkpoints``, oldest (lowest ``n``) first.

    These are the folders that automatic checkpoint naming writes; committed
    or not.

    Example::

        latest = checkpoint_folders(accelerator)[-1]
    """
    root = _checkpoints_root(accelerator)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _FOLDER.match(name))]
    return [os.path.join(root, name) for _, name in sorted(found)]


def _checkpoints_root(accelerator: Accelerator) -> str:
    if accelerator.project_dir is None:
        raise ValueError(
            "automatic checkpoint naming needs a project folder: pass "
            "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) to the Accelerator"
        )
    return os.path.join(accelerator.project_dir, "checkpoints")


def _automatic(accelerator: Accelerator) -> bool:
    return bool(accelerator.project_configuration.automatic_checkpoint_naming)


def _save_folder(accelerator: Accelerator, output_dir: str | os.PathLike | None) -> str:
    """Where this save goes: ``output_dir``, or the next ``checkpoint_<iteration>`` under automatic naming."""
    if not _automatic(accelerator):
        if output_dir is None:
            raise ValueError("save_state needs an output_dir when automatic checkpoint naming is disabled")
        return os.fspath(output_dir)
    iteration = accelerator.project_configuration.iteration
    path = os.path.join(_checkpoints_root(accelerator), f"checkpoint_{iteration}")
    if os.path.exists(path):
        raise ValueError(  # as Accelerate itself raises it
            f"{path} already exists: automatic checkpoint naming would overwrite iteration {iteration}; "
            "set accelerator.project_configuration.iteration to the next free number (for example "
            "after resuming) or remove that folder"
        )
    return path


def _rotate(accelerator: Accelerator) -> None:
    """Keep only the newest ``total_limit`` automatically named checkpoints (on the main process)."""
    limit = accelerator.project_configuration.total_limit
    if _automatic(accelerator) and limit is not None and accelerator.is_main_process:
        folders = checkpoint_folders(accelerator)
        for old in folders[: max(len(folders) - max(limit, 1), 0)]:
            log.info("removing %s: total_limit=%d keeps the newest checkpoints", old, limit)
            remove_path(old)
    if _automatic(accelerator):
        accelerator.wait_for_everyone()


def _hook_models(accelerator: Accelerator) -> list[Any]:
    """The models that Accelerate hands the state hooks: none under FSDP, which saves models itself."""
    return [] if accelerator.distributed_type == DistributedType.FSDP else list(accelerator._models)


def _main_decides(plan: list[Any], accelerator: Accelerator) -> list[Any]:
    """The main process's plan on every process: Accelerate writes model weights from it alone."""
    if accelerator.num_processes <= 1:
        return plan
    return Comm.resolve().broadcast(plan, src=0)


def _saved_models(accelerator: Accelerator, output_dir: str) -> list[Any]:
    """Run the save hooks and return what to save as ``model_<i>``, as Accelerate would.

    A weights dict a hook left as it was saves through its module (sharding
    aware, names without wrapper prefixes); one a hook replaced or edited is
    saved as given. Under FSDP the hooks see no weights and every model is saved.
    """
    if accelerator.distributed_type == DistributedType.FSDP:
        weights: list[Any] = []
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(accelerator._models, weights, output_dir)
        return list(accelerator._models)
    originals = [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models]
    snapshot = [(w, list(w.items())) for w in originals]
    weights = list(originals)
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, weights, output_dir)

    def untouched(w: Any) -> int | None:
        for j, (orig, items) in enumerate(snapshot):
            if w is orig and len(w) == len(items) and all(w.get(k) is v for k, v in items):
                return j
        return None

    plan = []
    for w in weights:
        j = untouched(w)
        plan.append(j if j is not None else {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in w.items()})
    plan = _main_decides(plan, accelerator)
    return [accelerator._models[p] if isinstance(p, int) else p for p in plan]


def save_state(
    accelerator: Accelerator,
    output_dir: str | os.PathLike | None = None,
    safe_serialization: bool = True,
    *,
    extra: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> SaveResult:
    """Save ``accelerator``'s state to ``output_dir``, as ``accelerator.save_state`` would; call it on every process.

    With automatic checkpoint naming (``ProjectConfiguration``) leave
    ``output_dir`` out: the state goes to the next
    ``<project_dir>/checkpoints/checkpoint_<iteration>`` and older folders
    beyond ``total_limit`` are removed once it is committed. The save-state
    hooks run first; every save advances the project's ``iteration``.
    ``safe_serialization`` is accepted for compatibility: shardpoint's format
    holds no pickled code either way. Other keyword arguments go to
    :func:`shardpoint.save`; the result's ``path`` says where the state went.

    Example::

        save_state(accelerator, "ckpt/step_100")
        save_state(accelerator)  # with automatic_checkpoint_naming=True
    """
    del safe_serialization  # the format is safe in every case
    path = _save_folder(accelerator, output_dir)
    if _automatic(accelerator):
        accelerator.wait_for_everyone()  # every process checked the folder is new before any creates it
    if "://" not in path:  # as Accelerate does, the hooks may write into the folder
        os.makedirs(path, exist_ok=True)
    models = _saved_models(accelerator, path)
    result = save(path, accelerator_state(accelerator, extra, models=models), **kwargs)
    _rotate(accelerator)
    accelerator.project_configuration.iteration += 1
    return result


def _load_folder(accelerator: Accelerator, input_dir: str | os.PathLike | None) -> str:
    """What to load: ``input_dir``, or the newest committed automatically named checkpoint."""
    if input_dir is not None:
        return os.path.expanduser(os.fspath(input_dir))
    if not _automatic(accelerator):
        raise ValueError("load_state needs an input_dir when automatic checkpoint naming is disabled")
    folders = checkpoint_folders(accelerator)
    for path in reversed(folders):
        try:
            read_manifest(path, chunks=False)
            return path
        except CheckpointError as e:
            log.warning("skipping %s, not a loadable checkpoint: %s", path, e)
    raise CheckpointNotFoundError(
        f"no committed checkpoint under {_checkpoints_root(accelerator)} (found {len(folders)} checkpoint_<n> "
        "folders): save one with save_state(accelerator) first, or pass the folder to load"
    )


def load_state(
    accelerator: Accelerator,
    input_dir: str | os.PathLike | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    map_location: Any = None,
    **kwargs: Any,
) -> LoadResult:
    """Restore ``accelerator``'s state from ``input_dir`` in place, as ``accelerator.load_state`` would; call it on every process.

    Prepare the same models, optimizers and schedulers (and register the same
    objects) first. With automatic checkpoint naming and no ``input_dir`` the
    newest committed ``checkpoint_<n>`` is loaded. The load-state hooks run
    first; a model they remove from ``models`` is left to them. The state
    lands in place on the devices it lives on, so ``map_location`` (``None``,
    ``"cpu"`` or ``"on_device"``, as Accelerate accepts) changes nothing. ``load_kwargs`` may hold ``strict``.
    Other keyword arguments go to :func:`shardpoint.load`; with the default
    ``strict=True`` anything missing on either side raises
    :class:`~shardpoint.errors.KeyMismatchError`. The returned
    :class:`~shardpoint.LoadResult` carries the path, timings and bytes read.

    Example::

        model, opt, sched = accelerator.prepare(model, opt, sched)
        load_state(accelerator, "ckpt/step_100")
        load_state(accelerator)  # the newest, with automatic_checkpoint_naming=True
    """
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError(
            f"Unsupported optimizer map location passed: {map_location!r}; use None, 'cpu' or 'on_device' "
            "(the state is restored into the live tensors, on their own devices, either way)"
        )
    options = dict(load_kwargs or {})
    if "strict" in options:
        kwargs.setdefault("strict", bool(options.pop("strict")))
    if options:
        raise TypeError(f"load_state: unsupported load_kwargs {sorted(options)}; only 'strict' is accepted")
    path = _load_folder(accelerator, input_dir)
    models = _hook_models(accelerator)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, path)
    if accelerator.distributed_type == DistributedType.FSDP:
        models = list(accelerator._models)
    kwargs.pop("return_result", None)
    return load(path, accelerator_state(accelerator, extra, models=models), return_result=True, **kwargs)
