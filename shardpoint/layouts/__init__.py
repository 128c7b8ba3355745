"""A declarative layout language: stored tensors as views of logical tensors.

Some tensors a framework keeps are not plain shards of one logical tensor: a
fused QKV projection (with grouped-query attention), a fused gate/up
projection, a vocabulary padded to a multiple of the TP size. A *rule* says how
such a physical tensor maps onto logical ones along one dimension; the
checkpoint then stores only logical tensors, and any layout (fused or not,
any TP degree, one process) loads them. Rules resolve at save and load time:
no offline conversion, no temporary tree.

The physical tensor is the framework's *global* tensor, whose shards the
DTensor placements describe. Along ``dim`` it is cut into segments, each a
contiguous range of one logical tensor; a shard box is split by intersecting
it with the segments, which is the same box arithmetic as resharding.

Rules:

- :class:`Fused`: ``parts`` are ``(name, rows per group)``; the physical dim
  repeats ``groups`` times ``[part0, part1, ...]``. ``groups=1`` is a plain
  concatenation (gate/up); Megatron-style GQA QKV is ``groups=num_kv_heads``
  with parts ``(("wq", q_per_group * head_dim), ("wk", head_dim), ("wv", head_dim))``.
- :class:`Padded`: only the first ``size`` entries along ``dim`` are real; the
  padding is not stored and is zero-filled on load.

Names: ``pattern`` is a glob over parameter names (``"*.attn.wqkv.weight"``).
A matched name's module component (``wqkv``) is replaced by each part's name
(``wq``, ``wk``, ``wv``); optimizer state of that parameter
(``<opt>.state.<param>.<key>``) follows the same rule.

Example (a Llama block whose QKV and gate/up are fused)::

    rules = [
        sp.Fused("*.attn.wqkv.weight", dim=0, groups=8,
                 parts=[("wq", 4 * 128), ("wk", 128), ("wv", 128)]),
        sp.Fused("*.mlp.w13.weight", dim=0, parts=[("w1", 14336), ("w3", 14336)]),
        sp.Padded("tok.weight", dim=0, size=128256),
    ]
    sp.save(path, state, layouts=rules)   # stores wq, wk, wv, w1, w3, tok (unpadded)
    sp.load(path, state, layouts=rules)   # or load into an unfused model with no rules
"""

from .apply import LayoutView, apply_load, apply_save
from .naming import optimizer_doc_to_logical, optimizer_doc_to_physical
from .rules import Fused, Padded, Reduced, Rule, Segment, WholeRule, find_rule

__all__ = [
    "WholeRule",
    "Fused",
    "Padded",
    "Reduced",
    "Rule",
    "Segment",
    "find_rule",
    "apply_save",
    "apply_load",
    "LayoutView",
    "optimizer_doc_to_logical",
    "optimizer_doc_to_physical",
]
