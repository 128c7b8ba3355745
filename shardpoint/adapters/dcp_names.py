"""Optimizer naming: shardpoint's scheme and the one PyTorch DCP uses, mapped both ways.

shardpoint keys optimizer state by the parameter's name *in the state*
(``<opt>.state.<state key>.<param>.<name>``, for example
``optimizer.state.model.layers.0.w.exp_avg``) and stores the entry's value
document as ``{"groups": [hyper-parameters], "group_of": {param: group},
"state": {param: {name: value}}}``.

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keys the
same state by the parameter's name *in the model* and groups as
``param_groups`` that list their parameters' names: ``{"state": {"layers.0.w":
{...}}, "param_groups": [{"lr": ..., "params": ["layers.0.w", ...]}]}``.
Saved by DCP as ``{"model": ..., "optimizer": ...}`` its tensors are named
``optimizer.state.layers.0.w.exp_avg``.

Both mappings here are pure functions on JSON value documents (tensor
references are left pointing at the tensors as stored, so no tensor is
renamed or copied):

- :func:`native_to_dcp` for export, so that ``dcp.load`` fills the dict that
  ``get_optimizer_state_dict`` returns;
- :func:`dcp_to_native` for load, a naming view that lets ``sp.load`` restore
  an optimizer from a checkpoint keyed the DCP way (an imported DCP folder, or
  ``sp.save`` of ``get_optimizer_state_dict``'s dict).

Example::

    doc = manifest.values["optimizer"]
    if is_dcp_optimizer_doc(doc):
        doc = dcp_to_native(doc, ["model.w", "model.b"], where)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..errors import FormatError

__all__ = ["WRAPPER_NAMES", "dcp_param_name", "rename_refs", "is_dcp_optimizer_doc", "is_native_optimizer_doc", "native_to_dcp", "dcp_to_native"]

# Module-name components that wrappers insert and DCP's state-dict helpers drop
# (activation checkpointing, torch.compile, FSDP1).
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def dcp_param_name(native: str) -> str:
    """The name DCP gives the parameter that shardpoint calls ``native``.

    Drops the state key (``model.``) and wrapper components.

    Example::

        dcp_param_name("model.layers.0._checkpoint_wrapped_module.w")  # "layers.0.w"
    """
    parts = native.split(".")[1:]
    return ".".join(p for p in parts if p not in WRAPPER_NAMES)


def rename_refs(doc: Any, fn: Callable[[str], str]) -> Any:
    """A copy of value document ``doc`` whose tensor references are renamed by ``fn``.

    Example::

        rename_refs({"a": {"__sp__": "tensor", "key": "x"}}, str.upper)  # key "X"
    """
    if isinstance(doc, dict):
        if doc.get("__sp__") == "tensor":
            return {**doc, "key": fn(doc["key"])}
        return {k: rename_refs(v, fn) for k, v in doc.items()}
    if isinstance(doc, list):
        return [rename_refs(v, fn) for v in doc]
    return doc


def is_native_optimizer_doc(doc: Any) -> bool:
    """Whether ``doc`` is an optimizer document in shardpoint's own scheme."""
    return isinstance(doc, dict) and isinstance(doc.get("groups"), list) and isinstance(doc.get("group_of"), dict) and isinstance(doc.get("state"), dict)


def is_dcp_optimizer_doc(doc: Any) -> bool:
    """Whether ``doc`` is an optimizer document keyed the way ``get_optimizer_state_dict`` keys it.

    Its groups list their parameters by name (strings); a ``torch.optim``
    ``state_dict()`` (integer ids) is not this scheme.
    """
    if not isinstance(doc, dict) or set(doc) != {"state", "param_groups"}:
        return False
    groups, state = doc["param_groups"], doc["state"]
    if not isinstance(groups, list) or not isinstance(state, dict) or "__sp__" in state:
        return False
    return all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
        for g in groups
    )


def native_to_dcp(doc: dict, where: str = "<checkpoint>") -> dict:
    """Rewrite a shardpoint optimizer document as ``get_optimizer_state_dict`` lays it out.

    Raises :class:`~shardpoint.errors.FormatError` when two parameters map to
    one DCP name (two modules in the state with the same parameter names) or
    a parameter's group is out of range.
    """
    if not is_native_optimizer_doc(doc):
        raise FormatError(f"{where}: not a shardpoint optimizer document")
    groups = doc["groups"]
    params: list[list[str]] = [[] for _ in groups]
    owner: dict[str, str] = {}

    def rename(native: str) -> str:
        name = dcp_param_name(native)
        prev = owner.setdefault(name, native)
        if prev != native:
            raise FormatError(
                f"{where}: optimizer parameters {prev!r} and {native!r} both have the DCP name {name!r}; "
                "export them from separate checkpoints or rename one"
            )
        return name

    for native, gi in doc["group_of"].items():
        if not isinstance(gi, int) or not 0 <= gi < len(groups):
            raise FormatError(f"{where}: optimizer parameter {native!r} names group {gi!r} of {len(groups)}")
        params[gi].append(rename(native))
    state = {}
    for native, sdoc in doc["state"].items():
        name = rename(native)
        if native not in doc["group_of"]:
            raise FormatError(f"{where}: optimizer state of {native!r} belongs to no group")
        state[name] = sdoc
    out_groups = []
    for g, names in zip(groups, params):
        if not isinstance(g, dict) or "params" in g:
            raise FormatError(f"{where}: malformed optimizer group {g!r}")
        out_groups.append({**g, "params": names})
    return {"state": state, "param_groups": out_groups}


def dcp_to_native(doc: dict, params: Iterable[str], where: str = "<checkpoint>") -> dict:
    """A shardpoint optimizer document from one keyed the DCP way, for an optimizer over ``params``.

    ``params`` are the shardpoint names of the target optimizer's parameters
    (``model.layers.0.w``). Each saved DCP name is matched to the parameter
    with that :func:`dcp_param_name`; saved names that match none keep their
    DCP name, so the load reports them as unexpected. Tensor references keep
    the names the tensors are stored under.
    """
    if not is_dcp_optimizer_doc(doc):
        raise FormatError(f"{where}: not an optimizer document keyed by parameter names")
    native_of: dict[str, str] = {}
    clash: set[str] = set()
    for native in params:
        name = dcp_param_name(native)
        if native_of.setdefault(name, native) != native:
            clash.add(name)

    def native(name: str) -> str:
        if name in clash:
            raise FormatError(
                f"{where}: saved optimizer parameter {name!r} matches several parameters of the "
                "target optimizer; load the modules into separate optimizers"
            )
        return native_of.get(name, name)

    groups, group_of = [], {}
    for gi, g in enumerate(doc["param_groups"]):
        groups.append({k: v for k, v in g.items() if k != "params"})
        for name in g["params"]:
            n = native(name)
            if n in group_of:
                raise FormatError(f"{where}: optimizer parameter {name!r} is listed in two groups")
            group_of[n] = gi
    state = {}
    for name, sdoc in doc["state"].items():
        state[native(name)] = sdoc
    return {"groups": groups, "group_of": group_of, "state": state}
