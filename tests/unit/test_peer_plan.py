"""Pure planning of peer-memory checkpoints: replica placement, transfers, complete steps, sources."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.peer.plan import HostListing, StepCopy, choose_memory_step, complete_steps, replica_hosts, transfers

hosts_st = st.lists(st.sampled_from([f"h{i}" for i in range(8)]), min_size=1, max_size=8, unique=True)


@settings(max_examples=200, deadline=None)
@given(hosts_st, st.integers(0, 9), st.data())
def test_replicas_distinct_never_self_other_domains_first(hosts, replicas, data):
    domains = {h: data.draw(st.sampled_from(["r0", "r1", "r2"])) for h in hosts}
    for h in hosts:
        got = replica_hosts(hosts, h, replicas, domains)
        assert h not in got and len(set(got)) == len(got) == min(replicas, len(hosts) - 1)
        others = [x for x in hosts if domains[x] != domains[h]]
        # Hosts of another failure domain come before any host of the same domain.
        assert [domains[x] != domains[h] for x in got] == sorted([domains[x] != domains[h] for x in got], reverse=True)
        assert sum(domains[x] != domains[h] for x in got) == min(len(got), len(others))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_transfers_balanced(nhosts, per_host, replicas):
    rank_hosts = [f"h{r // per_host}" for r in range(nhosts * per_host)]
    plan = transfers(rank_hosts, {r: [f"f{r}"] for r in range(len(rank_hosts))}, replicas)
    k = min(replicas, nhosts - 1)
    for r, h in enumerate(rank_hosts):
        sent = [t for t in plan if t.src == r]
        assert len(sent) == k and len([t for t in plan if t.dst == r]) == k
        assert all(rank_hosts[t.dst] != h for t in sent) and len({rank_hosts[t.dst] for t in sent}) == k


def _copy(step, files, manifest=True, save_id="s", needs=None):
    return StepCopy(step, save_id, {f: 10 for f in files}, needs if manifest else None, manifest)


def test_complete_needs_every_file_on_some_host_and_one_save():
    need = {"a": 10, "b": 10}
    h0 = HostListing("h0", "/m0", (_copy(11, ["a", "b"], needs=need), _copy(12, ["a"], needs=need)))
    h1 = HostListing("h1", "/m1", (_copy(12, ["b"], needs=need),))
    assert complete_steps([h0, h1])[0][:2] == (12, "s")
    assert [c[0] for c in complete_steps([h0])] == [11]  # h1 lost: 12 is torn, 11 is whole on h0
    # A copy from another save of the same step, or of the wrong size, never completes it.
    h1b = HostListing("h1", "/m1", (_copy(12, ["b"], save_id="other", needs=need),))
    assert [c[0] for c in complete_steps([h0, h1b])] == [11]
    h1c = HostListing("h1", "/m1", (StepCopy(12, "s", {"b": 9}, need, True),))
    assert [c[0] for c in complete_steps([h0, h1c])] == [11]
    # Sources: own host first; only what is newer than the stored step is offered.
    ch = choose_memory_step([h0, h1], own="h1")
    assert ch[0].sources == {"a": ("h0",), "b": ("h1",)}
    assert [c.step for c in choose_memory_step([h0, h1], own="h0", newer_than=12)] == [12]
    assert choose_memory_step([h0, h1], own="h0", newer_than=13) == []


def test_server_rank_spreads_a_lost_hosts_files_over_the_serving_ranks():
    from shardpoint.peer.restore import server_rank

    # h1's ranks 2 and 3 wrote the files; h0's ranks 0 and 1 serve them, one each.
    assert [server_rank([0, 1], f"data/r{w}.bin", w) for w in (2, 3)] == [0, 1]
    assert [server_rank([4, 5, 6], f"data/r{w}.bin", w) for w in range(6)] == [4, 5, 6, 4, 5, 6]
    # A file of no known writer: the same choice on every rank, among the host's ranks.
    assert server_rank([0, 1], "x.json") == server_rank([0, 1], "x.json") in (0, 1)
