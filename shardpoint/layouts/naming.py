"""Optimizer state under layout rules: per-parameter entries renamed between physical and logical names.

A saved optimizer document keys its state by parameter name; where a rule
splits a parameter into logical parts, each part gets the parameter's entry
under its own name (and back, for loading into a fused model). Example::

    doc = optimizer_doc_to_logical("optimizer", doc, rules)
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .rules import Rule, find_rule

__all__ = ["optimizer_doc_to_logical", "optimizer_doc_to_physical"]


def _rename_refs(doc, fn):
    """Copy a value document, renaming tensor references with ``fn``."""
    if isinstance(doc, dict):
        if doc.get("__sp__") == "tensor":
            return {"__sp__": "tensor", "key": fn(doc["key"])}
        return {k: _rename_refs(v, fn) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rename_refs(v, fn) for v in doc]
    return doc


def optimizer_doc_to_logical(key: str, doc: dict, rules: Sequence[Rule]) -> dict:
    """Rewrite a saved optimizer document so per-parameter entries use logical names."""
    if not rules or not isinstance(doc, dict):
        return doc
    state, group_of = {}, {}
    for pname, gi in doc.get("group_of", {}).items():
        rule, m = find_rule(rules, pname)
        names = [pname] if rule is None else [rule.logical_name(pname, n) for n in rule.part_names()]
        for n in names:
            group_of[n] = gi
    for pname, sdoc in doc.get("state", {}).items():
        rule, m = find_rule(rules, pname)
        if rule is None:
            state[pname] = sdoc
            continue
        for n in rule.part_names():
            logical = rule.logical_name(pname, n)
            state[logical] = _rename_refs(sdoc, lambda f, p=pname, lg=logical: f.replace(f".state.{p}.", f".state.{lg}.", 1))
    return {**doc, "state": state, "group_of": group_of}


def optimizer_doc_to_physical(key: str, doc: dict, rules: Sequence[Rule], params: Iterable[str]) -> dict:
    """The inverse view for loading into a fused model: physical entries built from logical ones."""
    if not rules or not isinstance(doc, dict):
        return doc
    state = dict(doc.get("state", {}))
    group_of = dict(doc.get("group_of", {}))
    for pname in params:
        rule, m = find_rule(rules, pname)
        if rule is None:
            continue
        logical = [rule.logical_name(pname, n) for n in rule.part_names()]
        first = logical[0]
        if first in state:
            state[pname] = _rename_refs(state[first], lambda f, lg=first, p=pname: f.replace(f".state.{lg}.", f".state.{p}.", 1))
        if first in group_of:
            group_of[pname] = group_of[first]
        for n in logical:
            if n != pname:
                state.pop(n, None)
                group_of.pop(n, None)
    return {**doc, "state": state, "group_of": group_of}
