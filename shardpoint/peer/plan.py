"""Pure planning for peer-memory checkpoints: placement, completeness and sources.

Nothing here touches a process, a file or the network: hosts, folders and
files are plain values, so every rule is unit-tested (and property-tested) in
milliseconds. :mod:`shardpoint.peer.memory` runs these plans.

- :func:`replica_hosts`: where a host's shards are copied, across failure domains.
- :func:`transfers`: which rank sends which files to which rank to replicate them.
- :func:`choose_memory_step`: the newest step whose every file has a copy on a live host.
- :func:`source_order`: for each file, the hosts to read it from, own host first.

Example::

    replica_hosts(["h0", "h1", "h2"], "h0", 1)   # ('h1',)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = [
    "StepCopy",
    "HostListing",
    "Transfer",
    "MemoryChoice",
    "replica_hosts",
    "transfers",
    "complete_steps",
    "choose_memory_step",
    "source_order",
]


@dataclass(frozen=True)
class StepCopy:
    """What one host's memory folder holds of one step.

    ``files`` maps each present file to its size. ``needs`` is set when the
    folder holds the step's committed manifest: every file that manifest
    references, with its size (``-1`` where the manifest records no size).
    """

    step: int
    save_id: str
    files: Mapping[str, int]
    needs: Mapping[str, int] | None = None
    manifest: bool = False


@dataclass(frozen=True)
class HostListing:
    """One live host's announcement: its name, memory folder and the steps in it."""

    host: str
    dir: str
    steps: tuple[StepCopy, ...] = ()


@dataclass(frozen=True)
class Transfer:
    """Rank ``src`` sends ``names`` (files of its host's step folder) to rank ``dst``."""

    src: int
    dst: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class MemoryChoice:
    """The memory step to restore and, per file, the folders to read it from in order."""

    step: int
    save_id: str
    manifest_host: str
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # file -> host names


def replica_hosts(hosts: Sequence[str], host: str, replicas: int, domains: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The ``replicas`` hosts that keep copies of ``host``'s shards.

    Hosts are taken in ring order after ``host`` (so the load spreads evenly:
    every host receives as many copies as it sends), hosts in another failure
    domain first. Never ``host`` itself; fewer when there are not enough hosts.

    Example::

        replica_hosts(["a", "b", "c", "d"], "a", 1, {"a": "r1", "b": "r1", "c": "r2", "d": "r2"})  # ('c',)
    """
    order = sorted(set(hosts))
    if host not in order:
        raise ValueError(f"host {host!r} is not among {order}")
    i = order.index(host)
    ring = order[i + 1:] + order[:i]
    dom = domains or {}
    mine = dom.get(host, host)
    other = [h for h in ring if dom.get(h, h) != mine]
    same = [h for h in ring if dom.get(h, h) == mine]
    return tuple((other + same)[: max(0, int(replicas))])


def transfers(rank_hosts: Sequence[str], files: Mapping[int, Sequence[str]], replicas: int,
              domains: Mapping[str, str] | None = None) -> tuple[Transfer, ...]:
    """Who sends what to whom: each rank's ``files`` go to one rank of each replica host.

    ``rank_hosts[r]`` is rank ``r``'s host. The i-th rank of a host sends to
    the (i mod n)-th of the n ranks of each replica host, so with equal hosts
    every rank sends and receives the same number of transfers.
    """
    members: dict[str, list[int]] = {}
    for r, h in enumerate(rank_hosts):
        members.setdefault(h, []).append(r)
    hosts = sorted(members)
    out = []
    for r, h in enumerate(rank_hosts):
        names = tuple(files.get(r, ()))
        if not names:
            continue
        i = members[h].index(r)
        for peer in replica_hosts(hosts, h, replicas, domains):
            dst = members[peer][i % len(members[peer])]
            out.append(Transfer(r, dst, names))
    return tuple(out)


def complete_steps(listings: Sequence[HostListing]) -> list[tuple[int, str, str]]:
    """``(step, save_id, manifest host)`` of every complete step, newest first.

    A step is complete when some live host holds its committed manifest and
    every file that manifest references is present, at its recorded size, on
    at least one live host. Copies of other saves of the same step (another
    ``save_id``) never count: a step is never assembled from two saves.
    """
    found = []
    seen = set()
    for lst in listings:
        for c in lst.steps:
            if not c.manifest or c.needs is None or (c.step, c.save_id) in seen:
                continue
            seen.add((c.step, c.save_id))
            ok = True
            for name, size in c.needs.items():
                if not any(
                    o.step == c.step and o.save_id == c.save_id and name in o.files and (size < 0 or o.files[name] == size)
                    for other in listings for o in other.steps
                ):
                    ok = False
                    break
            if ok:
                found.append((c.step, c.save_id, lst.host))
    return sorted(found, key=lambda t: (-t[0], t[1]))


def source_order(listings: Sequence[HostListing], step: int, save_id: str, needs: Mapping[str, int], own: str) -> dict[str, tuple[str, ...]]:
    """For each needed file, the hosts holding a copy: ``own`` first, then the others by name."""
    out: dict[str, tuple[str, ...]] = {}
    hosts = sorted({lst.host for lst in listings}, key=lambda h: (h != own, h))
    by_host = {lst.host: lst for lst in listings}
    for name, size in needs.items():
        srcs = []
        for h in hosts:
            for c in by_host[h].steps:
                if c.step == step and c.save_id == save_id and name in c.files and (size < 0 or c.files[name] == size):
                    srcs.append(h)
                    break
        out[name] = tuple(srcs)
    return out


def choose_memory_step(listings: Sequence[HostListing], own: str, newer_than: int | None = None) -> list[MemoryChoice]:
    """Complete memory steps to try, newest first (only those ``>= newer_than`` when given).

    Each choice carries the sources of every file, ``own`` host first.
    """
    out = []
    for step, save_id, mhost in complete_steps(listings):
        if newer_than is not None and step < newer_than:
            continue
        needs = next(
            c.needs for lst in listings if lst.host == mhost for c in lst.steps
            if c.step == step and c.save_id == save_id and c.needs is not None
        )
        out.append(MemoryChoice(step, save_id, mhost, source_order(listings, step, save_id, needs, own)))
    return out
