"""The snapshot guard: an asynchronous save never commits a state that nobody held.

A lazy save copies the tensors that change only inside ``optimizer.step()``
in the background, after ``async_save`` returned. The state at the call is
what the checkpoint must hold, so any in-place change to one of those tensors
before the *fence* (``handle.fence()``, the optimizer's step pre-hook,
``handle.done()`` once the copy is complete, or ``handle.wait()``) fails the
save, whether or not the copy happened to finish first. The rule is the same
on every run, so a loop that is wrong for lazy mode fails on its first
checkpoint, not once in a hundred.

Two witnesses tell that a tensor changed:

- its version counter (``tensor._version``), which every in-place operation
  on the tensor or on a view of it bumps, at no cost;
- a sampled fingerprint (the raw bytes of :data:`SAMPLE_RUNS` short runs
  spread evenly over the tensor, :data:`SAMPLE_ELEMENTS` elements in all)
  of the :data:`FINGERPRINTED` largest tensors, which also sees writes
  through ``tensor.data``: those go to a tensor with a counter of its own.
  A loop that writes through ``.data`` (WGAN-style clipping, an old EMA)
  does so to every parameter, so the largest few tell; sampling them all
  would cost the loop milliseconds per save. Runs of neighbouring elements,
  not single elements spread as far apart, keep the sample to a few memory
  pages of a cold tensor. A change that touches only unsampled elements is
  seen by the version counter alone. On an accelerator the sample is
  gathered on the device, queued after the work before the call (the call
  does not wait for it).

At the fence the guard gives a :class:`Verdict` (:meth:`SnapshotGuard.judge`)
without waiting for the device: version counters are compared on the host;
a fresh sample of each fingerprinted tensor on an asynchronous device is
taken on the fencing thread's queue, so it holds the values as of the
fence, and compared with the call's on the device, its flags copied to host
memory without waiting. Whoever reads the verdict (:meth:`Verdict.error`,
the thread that commits) waits for them, inside the device's capture guard
(:meth:`~shardpoint.device.Device.capture_guard`), since it may run on a
worker while the training thread captures a graph. A synchronous device
compares everything at the fence.

Example::

    guard = SnapshotGuard.record(step_updates(state).live(ctx))
    ...  # the copy runs; the loop reaches the fence
    verdict = guard.judge("ckpt/step_100")   # at the fence: no wait for the device
    err = verdict.error()                    # before the commit: None, or a TornSnapshotError to raise
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch

from ..device import CopyEvent, CpuDevice, Device, device_for
from ..errors import TornSnapshotError
from ..adapters.tensors import local_shard

__all__ = [
    "SnapshotGuard", "Watch", "GuardedTensor", "Verdict", "QueuedComparison", "torn_error", "SAMPLE_ELEMENTS", "SAMPLE_RUNS", "FINGERPRINTED",
    "largest",
]

SAMPLE_ELEMENTS = 1024
"""The most elements one tensor's fingerprint samples."""

SAMPLE_RUNS = 16
"""How many runs of neighbouring elements a fingerprint's sample is made of."""

FINGERPRINTED = 8
"""How many of the largest host tensors also get a fingerprint."""

_NAMES_SHOWN = 5


@dataclass(frozen=True)
class GuardedTensor:
    """One watched tensor: its name, the tensor, its version and fingerprint at the call."""

    fqn: str
    tensor: torch.Tensor
    version: int
    fingerprint: torch.Tensor | None


def _sample_view(t: torch.Tensor) -> torch.Tensor | None:
    """The view of ``t``'s data that its fingerprint copies (runs spread evenly), or None where sampling is not cheap and exact."""
    t = local_shard(t)
    if t.device.type == "meta" or not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    n = flat.numel()
    if n <= SAMPLE_ELEMENTS:
        return flat
    step = n // SAMPLE_RUNS  # at least one run's length, as n exceeds SAMPLE_ELEMENTS
    return flat[:SAMPLE_RUNS * step].view(SAMPLE_RUNS, step)[:, :SAMPLE_ELEMENTS // SAMPLE_RUNS]


def _sampled(view: torch.Tensor) -> torch.Tensor:
    # Compared as bytes: NaN equals itself, and -0.0 differs from 0.0.
    return view.clone().view(torch.uint8)


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """A sample of ``t``'s raw bytes (:func:`_sample_view`), or None where sampling is not cheap and exact.

    On an accelerator the sample is queued on the caller's device queue: no wait here.
    """
    view = _sample_view(t)
    return None if view is None else _sampled(view)


def largest(tensors: Iterable[torch.Tensor], n: int = FINGERPRINTED) -> frozenset[int]:
    """The positions of the ``n`` tensors holding the most elements on this rank: the ones a guard samples.

    Example::

        largest([torch.zeros(3), torch.zeros(9), torch.zeros(1)], 1)  # frozenset({1})
    """
    sizes = [local_shard(t).numel() for t in tensors]
    return frozenset(heapq.nlargest(n, range(len(sizes)), key=sizes.__getitem__))


@dataclass(frozen=True)
class Watch:
    """What a guard watches: names and tensors, in parallel, and the positions it samples.

    Made once per kept copy order (:mod:`shardpoint.saving.copy_order`), so
    a repeated save only reads versions and takes its samples.

    Example::

        watch = Watch.of([("model.w", w)]); watch.names  # ('model.w',)
    """

    names: tuple[str, ...] = ()
    tensors: tuple[torch.Tensor, ...] = ()
    sampled: frozenset[int] = frozenset()
    views: Mapping[int, torch.Tensor | None] | None = None

    def steady(self) -> "Watch":
        """This watch with the views its samples copy made now, for a watch kept while its tensors stay put.

        Only for a watch kept while every tensor keeps its storage, shape and
        strides (a saver's copy order, while the entries' fingerprints hold):
        a view made now then still views the data a fresh one would.

        Example::

            watch = Watch.of([("model.w", w)]).steady()
        """
        return replace(self, views={i: _sample_view(self.tensors[i]) for i in sorted(self.sampled)})

    @staticmethod
    def of(pairs: Iterable[tuple[str, torch.Tensor]], sampled: frozenset[int] | None = None) -> "Watch":
        """The watch of ``(name, tensor)`` pairs; ``sampled`` defaults to the :func:`largest`.

        Example::

            Watch.of([("a", a), ("b", b)], frozenset({1}))
        """
        pairs = tuple(pairs)
        tensors = tuple(t for _, t in pairs)
        return Watch(tuple(n for n, _ in pairs), tensors, largest(tensors) if sampled is None else frozenset(sampled))


class SnapshotGuard:
    """The versions (and fingerprints) of the tensors of one save, taken at the call.

    Example::

        guard = SnapshotGuard.record([("model.w", w)])
        w.mul_(2)
        guard.changed()   # ["model.w"]
    """

    def __init__(self, names: Sequence[str], tensors: Sequence[torch.Tensor], versions: Sequence[int],
                 fingerprints: Mapping[int, torch.Tensor], device: Device | None = None):
        # Parallel sequences, not an object per tensor: a sharded model's guard watches thousands at every save.
        self.names, self.tensors, self.versions = tuple(names), tuple(tensors), tuple(versions)
        self.fingerprints = dict(fingerprints)
        self.device = device if device is not None else CpuDevice()

    @classmethod
    def record(cls, tensors: Iterable[tuple[str, torch.Tensor]], device: Device | None = None,
               sampled: frozenset[int] | None = None) -> "SnapshotGuard":
        """Watch ``(name, tensor)`` pairs as they are now; ``device`` is the one the save stages from.

        ``sampled``: the positions that also get a fingerprint (default: the
        :func:`largest`); a saver that watches the same tensors again passes
        the positions it found before instead of sizing every tensor again.

        Example::

            guard = SnapshotGuard.record([("model.w", w), ("optimizer.state.model.w.exp_avg", m)])
        """
        return cls.take(Watch.of(tensors, sampled), device)

    @classmethod
    def take(cls, watch: Watch, device: Device | None = None) -> "SnapshotGuard":
        """Watch ``watch``'s tensors as they are now: their versions, and samples of those it samples.

        Example::

            guard = SnapshotGuard.take(Watch.of([("model.w", w)]))
        """
        ts = watch.tensors
        if watch.views is not None:
            prints = {i: _sampled(v) for i, v in watch.views.items() if v is not None}
        else:
            prints = {i: fp for i in sorted(watch.sampled) if (fp := _fingerprint(ts[i])) is not None}
        return cls(watch.names, ts, [t._version for t in ts], prints, device)

    @property
    def watched(self) -> list[GuardedTensor]:
        """Every watched tensor with its version and fingerprint at the call (for inspection).

        Example::

            [g.fqn for g in guard.watched if g.fingerprint is not None]  # the sampled ones
        """
        return [GuardedTensor(n, t, v, self.fingerprints.get(i))
                for i, (n, t, v) in enumerate(zip(self.names, self.tensors, self.versions))]

    def __len__(self) -> int:
        return len(self.tensors)

    def judge(self, path: str) -> "Verdict":
        """The fence's check, queued where it can be: what changed since :meth:`record`, read later with :meth:`Verdict.error`.

        Version counters are compared now, on the host, at no cost. A
        sample of a tensor on an asynchronous device is taken now, on the
        calling thread's queue (so it holds the values as of the fence), and
        compared with the call's on the device, its flags copied to host
        memory without waiting: the calling thread never waits for the
        device here; whoever reads the verdict does. Anything else is
        compared now.

        Example::

            verdict = guard.judge("ckpt/step_100")   # at the fence: no wait for the device
            err = verdict.error()                    # before the commit: waits for the flags
        """
        seen: list[tuple[int, str]] = []
        on_device: dict[int, tuple[Device, list[tuple[int, str]], list]] = {}
        with self.device.capture_guard():
            for i, (t, v) in enumerate(zip(self.tensors, self.versions)):
                if t._version != v:
                    seen.append((i, self.names[i]))
                elif i in self.fingerprints:
                    then, now = self.fingerprints[i], _fingerprint(t)
                    if now is None or now.shape != then.shape:
                        seen.append((i, self.names[i]))
                        continue
                    dev = self._device_of(now)
                    if not dev.asynchronous:
                        if not torch.equal(now, then):
                            seen.append((i, self.names[i]))
                        continue
                    group = on_device.setdefault(id(dev), (dev, [], []))
                    group[1].append((i, self.names[i]))
                    group[2].append((now, then))
            queued = tuple(_queue_compare(dev, names, pairs) for dev, names, pairs in on_device.values())
        return Verdict(path, tuple(seen), queued)

    def _device_of(self, sample: torch.Tensor) -> Device:
        # The guard's device for its own tensors; another accelerator's (one per process) for a tensor elsewhere.
        return self.device.member_for(sample) if self.device.owns(sample) else device_for(sample.device)

    def changed(self) -> list[str]:
        """The names of the watched tensors changed in place since :meth:`record` (waits for the device).

        Example::

            if guard.changed(): ...
        """
        return self.judge("").changed()

    def check(self, path: str) -> TornSnapshotError | None:
        """A :class:`TornSnapshotError` naming what changed since :meth:`record`, or None (waits for the device).

        The fence on an asynchronous device uses :meth:`judge` instead, and
        leaves the wait to the writer.

        Example::

            err = guard.check("ckpt/step_100")
            if err is not None: raise err
        """
        return self.judge(path).error()


def _queue_compare(dev: Device, names: list[tuple[int, str]], pairs: list) -> "QueuedComparison":
    """Compare the samples ``pairs`` on ``dev``, after the caller's work so far; one flag per pair lands in host memory."""

    def compute() -> torch.Tensor:
        return torch.stack([(now != then).any() for now, then in pairs])

    flags, event = dev.queue_to_host(compute, dev.snapshot_point())
    for now, then in pairs:  # read on the device's queue: not reused before the comparison ran
        dev.keep_alive(now, event)
        dev.keep_alive(then, event)
    return QueuedComparison(tuple(names), flags, event)


@dataclass(frozen=True, eq=False)
class QueuedComparison:
    """Samples being compared on a device: ``flags`` (host memory) holds one nonzero flag per changed tensor once ``event`` completed.

    Example::

        QueuedComparison(((0, "model.w"),), flags, event)
    """

    names: tuple[tuple[int, str], ...]
    flags: torch.Tensor
    event: CopyEvent

    def changed(self) -> list[tuple[int, str]]:
        """The positions and names whose samples differ; waits for the device's comparison."""
        self.event.synchronize()  # in the device's capture guard: legal while another thread captures
        return [n for n, f in zip(self.names, self.flags.tolist()) if f]


@dataclass(frozen=True, eq=False)
class Verdict:
    """The guard's verdict on one save, taken at the fence and read before the commit.

    ``seen``: the positions and names found changed at the fence itself;
    ``queued``: comparisons still running on a device. :meth:`error` waits
    for them (the writer calls it, never the training thread) and names
    every changed tensor in the order they are watched. ``failure``: the
    check itself failed, so the state cannot be proven and the save fails.

    Example::

        verdict = guard.judge("ckpt/step_100")
        if (err := verdict.error()) is not None: raise err
    """

    path: str
    seen: tuple[tuple[int, str], ...] = ()
    queued: tuple[QueuedComparison, ...] = ()
    failure: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether part of the verdict is still computed on a device (reading it would wait)."""
        return bool(self.queued)

    def changed(self) -> list[str]:
        """The names of the tensors changed before the fence, in the guard's order; waits for the device."""
        hits = list(self.seen)
        for q in self.queued:
            hits.extend(q.changed())
        return [n for _, n in sorted(hits)]

    def error(self) -> TornSnapshotError | None:
        """A :class:`TornSnapshotError` naming what changed, or None; never raises.

        Example::

            torn = verdict.error()
        """
        try:
            if self.failure is not None:
                raise self.failure
            names = self.changed()
        except Exception as e:  # noqa: BLE001 - an unproven snapshot must not commit
            err = TornSnapshotError(
                f"the lazy save to {self.path} was abandoned: its snapshot could not be checked at the fence "
                f"({type(e).__name__}: {e}). Nothing was committed; the previous checkpoint at the path is intact. "
                f"Save again, or save with mode='eager' if it persists.", [])
            err.__cause__ = e
            return err
        return torn_error(self.path, names) if names else None


def torn_error(path: str, names: Sequence[str]) -> TornSnapshotError:
    """The error of a lazy save to ``path`` whose tensors ``names`` changed before the fence.

    Example::

        torn_error("ckpt/step_100", ["model.w"])
    """
    shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return TornSnapshotError(
        f"the lazy save to {path} was abandoned: {shown}{more} changed in place after async_save() returned "
        f"and before the snapshot's fence, so the checkpoint would hold a state that never existed. "
        f"Nothing was committed; the previous checkpoint at the path is intact. Lazy mode copies parameters "
        f"and optimizer state in the background until the next optimizer.step(): call handle.fence() before "
        f"changing them anywhere else (an EMA, a clamp, manual weight decay, touching optimizer moments), "
        f"or save with mode='eager'.",
        list(names),
    )
