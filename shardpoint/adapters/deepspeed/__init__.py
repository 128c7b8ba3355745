"""DeepSpeed ZeRO (stages 1, 2 and 3): flat fp32 partitions saved as they are.

ZeRO keeps the fp32 master weights, and the optimizer moments, in one flat
1-D buffer per parameter group and gives every data-parallel rank one slice
of it. That slice cuts original parameters at arbitrary element positions:

* **ZeRO-1/2** (``DeepSpeedZeroOptimizer``): the group's parameters are
  concatenated (``round_robin_bit16_groups`` at ``round_robin_bit16_offsets``,
  padded to a multiple of the world size) and split into ``world`` slices;
  rank ``r`` holds ``single_partition_of_fp32_groups[i]``, elements
  ``[r * P, (r + 1) * P)`` of the group.
* **ZeRO-3** (``DeepSpeedZeroOptimizer_Stage3``): every parameter is split on
  its own into ``ceil(numel / world)``-element slices (``param.ds_tensor``);
  a rank's fp32 master ``fp32_partitioned_groups_flat[j]`` concatenates its
  slices of the parameters of sub-group ``j``.

Nothing is gathered. Each piece of an original parameter in the local slice
is saved as a flat range of that parameter's row-major order, under the
model's own names (``model.layers.0.attn.wq.weight``), and the optimizer
moments of the same slice likewise (``optimizer.state.<param>.exp_avg``, see
:mod:`shardpoint.adapters.optimizer`, whose per-parameter *views* do the
splitting). So a ZeRO checkpoint is the same checkpoint an FSDP2, TP, DDP or
single-process run of the same model writes, and loads into any of them; a
checkpoint of any of them loads into ZeRO at any world size and stage.

Loading fills the local fp32 partition in place (targets with flat ranges).
The low-precision copies DeepSpeed trains with are refreshed without a
collective: under ZeRO-1/2 every rank holds every parameter whole, so each
one is read whole (the target needs it); under ZeRO-3 each rank copies its
fp32 slices into its ``ds_tensor`` partitions, and reads whole only the
parameters it holds gathered right now (persistent small parameters).

Pass the engine and its optimizer, exactly as for any other layout::

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
    sp.save("ckpt/step_100", {"model": engine, "optimizer": optimizer})   # no all-gather
    sp.load("ckpt/step_100", {"model": engine, "optimizer": optimizer})   # from any layout

``engine.module`` may stand in for ``engine`` when the optimizer is in the
same state. With ``engine`` the model entry also records DeepSpeed's step
counters (``global_steps``, ``global_samples``, ``skipped_steps``) and
restores them when present. Supported: one data-parallel group spanning the
whole process group (no DeepSpeed tensor/pipeline parallelism, no ZeRO++
hpZ or MiCS), optimizer states in memory (no NVMe swapping), fp32 or bf16
training. ZeRO stage 0 engines with a plain torch optimizer work as plain
modules; the optimizer is saved and loaded by the generic optimizer adapter.

Expert parallelism under ZeRO-1/2: the local experts of a
``deepspeed.moe.layer.MoE`` layer live in MoE param groups that ZeRO
partitions over the expert data-parallel group instead. Their pieces are
saved under the experts' global names (``...deepspeed_experts.5.weight``,
see :func:`~shardpoint.adapters.deepspeed.moe.deepspeed_expert_rules`), moments
included, so such a checkpoint loads at any EP degree and ZeRO stage 1 or 2
(or without DeepSpeed). A load keeps the MoE param groups' ``name`` (their
expert-parallel group, ``ep_size_2``), which describes the loading engine.
A MoE group holding anything but those experts is refused with
:class:`~shardpoint.errors.UnsupportedStateError`, as is a layout whose
expert and expert data-parallel groups do not make up the process group.
DeepSpeed itself runs its native MoE under ZeRO stage 1 and 2 only.

At stage 0 (and for a torch optimizer over DeepSpeed's MoE param groups,
``moe: True``, with no engine in the state) the experts are stored the same
way. The generic optimizer adapter restores each group's hyper-parameters,
but not the keys :func:`live_group_keys` declares for that optimizer in the
context (``name`` and ``moe``): they describe the loading engine, whose
expert-parallel groups DeepSpeed looks up by that name. So after a load
of a checkpoint saved at EP 2, an EP 1 engine's MoE group is still named
``ep_size_1``.

The package keeps apart what changes for different reasons:
:mod:`.partition` is the pure ZeRO arithmetic (which elements of which
parameter each rank's flat slice holds; also used by the converter of native
DeepSpeed checkpoints), :mod:`.detect` recognises DeepSpeed objects without
importing DeepSpeed, :mod:`.zero_map` reads a live ZeRO optimizer into a
:class:`ZeroMap`, and :mod:`.adapter` saves and loads through it.
"""

from __future__ import annotations

from .adapter import DeepSpeedAdapter, scaler_doc
from .detect import is_deepspeed_engine, is_deepspeed_optimizer, is_zero_optimizer, live_group_keys, zero_stage
from .zero_map import ZeroMap, zero_facts, zero_map
from .partition import zero3_holders, zero3_pieces, zero12_holders, zero12_partitions, zero12_pieces

__all__ = [
    "zero12_partitions",
    "zero12_pieces",
    "zero12_holders",
    "zero3_pieces",
    "zero3_holders",
    "is_deepspeed_engine",
    "is_deepspeed_optimizer",
    "is_zero_optimizer",
    "zero_stage",
    "live_group_keys",
    "ZeroMap",
    "zero_map",
    "zero_facts",
    "scaler_doc",
    "DeepSpeedAdapter",
]
