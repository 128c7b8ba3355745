"""ResumableSampler / ResumableLoader: exactly-once data order across data-parallel resharding.

The sampler is a pure function of (state, rank, world), so whole multi-rank
runs are simulated here in one process: each "rank" is its own sampler, all
step in lockstep, and the global state is handed from one world size to the
next through ``state_dict``/``load_state_dict`` (or ``sp.save``/``sp.load``).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import shardpoint as sp
from shardpoint.training.data import ResumableLoader, ResumableSampler, epoch_permutation


def ranks(n, world, state=None, **kw):
    out = [ResumableSampler(n, rank=r, world_size=world, **kw) for r in range(world)]
    if state is not None:
        for s in out:
            s.load_state_dict(state)
    return out


def global_state(samplers):
    states = [s.state_dict() for s in samplers]
    assert all({k: v for k, v in x.items()} == states[0] for x in states), states  # rank-independent
    return states[0]


def run_segment(samplers, per_rank: int | None):
    """Every rank takes ``per_rank`` indices (None: to the end of the epoch); returns them all."""
    got = []
    if per_rank is not None:
        per_rank = min(per_rank, len(samplers[0]))  # asking for more would end the epoch
    for s in samplers:
        it = iter(s)
        got += list(it) if per_rank is None else list(itertools.islice(it, per_rank))
    return got


def expected(n, seed, shuffle, drop_last, tail):
    perm = epoch_permutation(n, seed, 0, shuffle).tolist()
    last_world, last_start = tail
    left = n - last_start
    if drop_last:
        return Counter(perm[: n - left % last_world])
    return Counter(perm + [perm[i % n] for i in range((-left) % last_world)])  # pad wraps P[0], P[1], ...


def simulate(n, seed, worlds, stops, shuffle=True, drop_last=False):
    """Run one epoch over a chain of world sizes; each but the last stops after ``stops[i]`` per rank.

    Returns the samples seen, the final state, and (world, start) of the segment that
    reached the end of the epoch: its world size decides the padding or dropping.
    """
    state, seen, tail = None, [], None
    for world, stop in zip(worlds, list(stops) + [None]):
        samplers = ranks(n, world, state, seed=seed, shuffle=shuffle, drop_last=drop_last)
        start = samplers[0].position
        assert start == (state or {"position": 0})["position"]
        left = len(samplers[0])
        if tail is None and (stop is None or 0 < left <= stop):  # this segment ends the epoch
            tail = (world, start)
        seen += run_segment(samplers, stop)
        state = global_state(samplers)
    return seen, state, tail


# ---------------------------------------------------------------- exactly once


@pytest.mark.parametrize("worlds", [(4, 2), (2, 3), (1, 4), (4, 2, 3), (3, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 150), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_exactly_once_across_resharding(worlds, drop_last, n, seed, data):
    stops = [data.draw(st.integers(0, n // w + 2), label=f"stop@{w}") for w in worlds[:-1]]
    seen, state, tail = simulate(n, seed, worlds, stops, drop_last=drop_last)
    assert Counter(seen) == expected(n, seed, True, drop_last, tail)
    assert (state["epoch"], state["position"]) == (1, 0)  # ran to the end: next epoch


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 120),
    worlds=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_exactly_once_any_chain(n, worlds, drop_last, shuffle, data):
    stops = [data.draw(st.integers(0, n // w + 2)) for w in worlds[:-1]]
    seen, _, tail = simulate(n, 7, worlds, stops, shuffle=shuffle, drop_last=drop_last)
    assert Counter(seen) == expected(n, 7, shuffle, drop_last, tail)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 100), world=st.integers(1, 6), k=st.integers(0, 30))
def test_lockstep_consumes_a_prefix(n, world, k):
    """After k samples per rank, exactly P[:k * world] is consumed (no tail reached)."""
    samplers = ranks(n, world, seed=3)
    k = min(k, (n // world) - 1) if n // world else 0
    got = run_segment(samplers, k)
    perm = epoch_permutation(n, 3, 0).tolist()
    assert sorted(got) == sorted(perm[: k * world])
    assert global_state(samplers)["position"] == k * world
    # Within a step the ranks never share a sample.
    assert len(set(got)) == len(got)


def test_explicit_4_to_2_mid_batch_boundary():
    # 4 ranks take 5 each (20 global), then 2 ranks finish: 30 of 50 left, 15 each, no padding.
    seen, _, tail = simulate(50, 11, (4, 2), [5])
    assert tail == (2, 20) and Counter(seen) == Counter(range(50))


def test_tail_policies_documented():
    # 10 samples on 4 ranks: pad repeats P[0], P[1]; drop skips the last two of the permutation.
    perm = epoch_permutation(10, 0, 0).tolist()
    pad = run_segment(ranks(10, 4, seed=0), None)
    assert Counter(pad) == Counter(perm + perm[:2]) and len(pad) == 12
    drop = run_segment(ranks(10, 4, seed=0, drop_last=True), None)
    assert sorted(drop) == sorted(perm[:8])
    assert [len(s) for s in ranks(10, 4, drop_last=True)] == [2] * 4
    assert [len(s) for s in ranks(10, 4)] == [3] * 4


def test_position_at_end_of_epoch_without_rollover():
    # All of a rank's samples consumed but the iteration not yet exhausted: position is the end.
    s = ResumableSampler(10, rank=0, world_size=4, seed=0, drop_last=True)
    assert list(itertools.islice(iter(s), 2)) and s.position == 10 and s.epoch == 0
    t = ResumableSampler(10, rank=0, world_size=3, seed=0, drop_last=True)
    t.load_state_dict(s.state_dict())
    assert list(t) == [] and (t.epoch, t.position) == (1, 0)  # nothing is re-read from the dropped tail


# ---------------------------------------------------------------- order and epochs


def test_permutation_is_stable_and_seeded():
    # Pinned: the order must never change under a resumed run (NumPy's legacy stream is frozen).
    assert epoch_permutation(12, 0, 0).tolist() == [0, 5, 6, 11, 10, 7, 8, 2, 9, 4, 3, 1]
    assert epoch_permutation(12, 0, 1).tolist() == [0, 1, 4, 6, 9, 3, 7, 10, 2, 8, 11, 5]
    assert epoch_permutation(12, 2**40 + 3, 7).tolist() == [11, 3, 10, 8, 6, 1, 9, 0, 2, 7, 4, 5]
    assert epoch_permutation(12, 1, 0).tolist() != epoch_permutation(12, 0, 1).tolist()
    assert epoch_permutation(5, 9, 9, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_epochs_roll_over_and_set_epoch():
    s = ResumableSampler(6, rank=0, world_size=1, seed=5)
    e0 = list(s)
    assert (s.epoch, s.position) == (1, 0)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(6)) and e0 != e1
    assert e1 == epoch_permutation(6, 5, 1).tolist()
    s.set_epoch(2)
    it = iter(s)
    next(it), next(it)
    s.set_epoch(2)  # the current epoch: position kept
    assert s.position == 2
    s.set_epoch(0)
    assert (s.epoch, s.position) == (0, 0) and list(s) == e0


def test_iteration_resumes_where_it_stopped():
    s = ResumableSampler(9, rank=0, world_size=1, seed=1)
    head = list(itertools.islice(iter(s), 4))
    tail = list(s)  # a new iteration continues the epoch
    assert head + tail == epoch_permutation(9, 1, 0).tolist()


def test_advance_and_len():
    s = ResumableSampler(100, rank=2, world_size=4, count_on_yield=False)
    assert len(s) == 25
    list(s)  # yields everything but counts nothing
    assert s.position == 0 and s.epoch == 0
    s.advance(10)
    assert s.position == 40 and len(s) == 15
    with pytest.raises(ValueError):
        s.advance(-1)


def test_errors():
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(10, rank=4, world_size=4)
    with pytest.raises(ValueError, match="both"):
        ResumableSampler(10, rank=0)
    s = ResumableSampler(10, rank=0, world_size=1)
    with pytest.raises(ValueError, match="covered 11 samples"):
        s.load_state_dict(ResumableSampler(11, rank=0, world_size=1).state_dict())
    with pytest.raises(ValueError, match="version"):
        s.load_state_dict({**s.state_dict(), "version": 99})
    with pytest.raises(ValueError, match="out of range"):
        s.load_state_dict({**s.state_dict(), "position": 11})
    with pytest.raises(ValueError, match="malformed"):
        s.load_state_dict({"version": 1})
    with pytest.raises(TypeError, match="ResumableSampler"):
        ResumableLoader(DataLoader(list(range(4)), batch_size=2))


def test_state_is_global_and_plain():
    a = ranks(30, 3, seed=2)
    run_segment(a, 4)
    sd = global_state(a)
    assert sd == {"version": 1, "epoch": 0, "seed": 2, "shuffle": True, "num_samples": 30,
                  "position": 12, "world_size": 3, "drop_last": False}
    b = ResumableSampler(30, rank=0, world_size=1, seed=999, shuffle=False)
    b.load_state_dict(sd)
    assert (b.seed, b.shuffle) == (2, True)  # the order comes from the checkpoint


# ---------------------------------------------------------------- DataLoader


def lockstep_loaders(n, world, batch, state=None, wrap=True, **kw):
    ds = list(range(n))
    out = []
    for r in range(world):
        s = ResumableSampler(ds, rank=r, world_size=world, seed=4)
        if state is not None:
            s.load_state_dict(state)
        dl = DataLoader(ds, batch_size=batch, sampler=s, **kw)
        out.append(ResumableLoader(dl) if wrap else dl)
    return out


def test_resumable_loader_reshards_through_sp_save(tmp_path):
    n = 53
    four = lockstep_loaders(n, 4, batch=3)
    its = [iter(x) for x in four]
    seen = [i for _ in range(2) for it in its for i in next(it).tolist()]
    sp.save(str(tmp_path / "c"), {"data": four[0]})
    m = sp.read_manifest(str(tmp_path / "c"))
    assert m.values["data"]["position"] == 24 and not m.tensors  # a plain manifest value
    two = lockstep_loaders(n, 2, batch=5)
    for x in two:
        sp.load(str(tmp_path / "c"), {"data": x})
    assert [len(x) for x in two] == [3, 3]  # 29 left: 15 each (one pad), batches of 5
    seen += [i for x in two for b in x for i in b.tolist()]
    perm = epoch_permutation(n, 4, 0).tolist()
    assert Counter(seen) == Counter(perm + perm[:1])
    assert all(x.epoch == 1 and x.sampler.position == 0 for x in two)


def test_loader_counts_delivered_batches_not_prefetched():
    """With worker prefetch the sampler runs ahead; only batches handed out count."""
    n = 40
    (plain,) = lockstep_loaders(n, 1, batch=2, wrap=False, num_workers=2, prefetch_factor=2)
    it = iter(plain)
    next(it)
    ahead = plain.sampler.position
    del it
    (wrapped,) = lockstep_loaders(n, 1, batch=2, num_workers=2, prefetch_factor=2)
    it = iter(wrapped)
    got = next(it).tolist() + next(it).tolist()
    assert wrapped.sampler.position == 4 < ahead  # the bare sampler counted prefetched indices
    state = wrapped.state_dict()
    del it
    (again,) = lockstep_loaders(n, 1, batch=2, state=state)
    rest = [i for b in again for i in b.tolist()]
    assert got + rest == epoch_permutation(n, 4, 0).tolist()


@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_plain_dataloader_counts_yielded_indices(loader_drop_last):
    # num_workers=0: the sampler counts what it yields, which is what was handed out.
    n, batch = 23, 4
    (dl,) = lockstep_loaders(n, 1, batch, wrap=False, drop_last=loader_drop_last)
    head = []
    for i, b in enumerate(dl):
        head += b.tolist()
        if i == 2:
            state = dl.sampler.state_dict()
            break
    assert state["position"] == 12
    (dl2,) = lockstep_loaders(n, 1, batch, state=state, wrap=False, drop_last=loader_drop_last)
    rest = [i for b in dl2 for i in b.tolist()]
    perm = epoch_permutation(n, 4, 0).tolist()
    assert head + rest == (perm[:20] if loader_drop_last else perm)
    assert (dl2.sampler.epoch, dl2.sampler.position) == (1, 0)


def test_loader_checkpoint_inside_last_batch_starts_next_epoch():
    (x,) = lockstep_loaders(8, 1, batch=4)
    states = [x.state_dict() for _ in x]
    assert [s["position"] for s in states] == [4, 8]
    (y,) = lockstep_loaders(8, 1, batch=4, state=states[-1])
    assert list(y) == [] and y.epoch == 1
    assert torch.cat(list(y)).tolist() == epoch_permutation(8, 4, 1).tolist()


def test_docstring_examples():
    import doctest

    import shardpoint.training.data

    assert doctest.testmod(shardpoint.training.data).failed == 0


def test_loader_iteration_leaves_the_global_torch_stream_alone():
    import torch
    from torch.utils.data import DataLoader

    from shardpoint.training.data import ResumableLoader, ResumableSampler

    data = list(range(20))
    loader = ResumableLoader(DataLoader(data, batch_size=2, sampler=ResumableSampler(data, rank=0, world_size=1)))
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    next(iter(loader))
    next(iter(loader))  # a resumed run opens an extra iterator: it must not consume the global stream
    assert torch.equal(torch.rand(3), want)
