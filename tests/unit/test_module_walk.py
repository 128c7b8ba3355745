"""The adapters' module walk: the modules of ``m.modules()``, in its order, each once."""

from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardpoint.adapters.graph import submodules


def _tree(shape: list, pool: list[nn.Module]) -> nn.Module:
    """A module tree from nested lists; an int ``i`` reuses ``pool[i % len(pool)]`` (a shared submodule)."""
    m = nn.Module()
    for k, child in enumerate(shape):
        if isinstance(child, int):
            m.add_module(f"s{k}", pool[child % len(pool)] if pool else None)
        else:
            sub = _tree(child, pool)
            pool.append(sub)
            m.add_module(f"c{k}", sub)
    return m


shapes = st.recursive(st.lists(st.integers(0, 5), max_size=3), lambda inner: st.lists(st.one_of(inner, st.integers(0, 5)), max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(shapes)
def test_walk_matches_modules_with_shared_and_missing_children(shape):
    m = _tree(shape, [])
    assert [id(x) for x in submodules(m)] == [id(x) for x in m.modules()]


def test_walk_of_a_shared_linear_lists_it_once_at_its_first_place():
    shared = nn.Linear(2, 2)
    m = nn.Sequential(nn.Sequential(shared), nn.ReLU(), shared)
    walked = submodules(m)
    assert walked == list(m.modules())
    assert [type(x).__name__ for x in walked] == ["Sequential", "Sequential", "Linear", "ReLU"]
