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
- a sampled fingerprint (a strided sample of the raw bytes, at most
  :data:`SAMPLE_ELEMENTS` elements) of the :data:`FINGERPRINTED` largest
  tensors, which also sees writes through ``tensor.data``: those go to
  a tensor with a counter of its own. A loop that writes through ``.data``
  (WGAN-style clipping, an old EMA) does so to every parameter, so the
  largest few tell; sampling them all would cost the loop milliseconds per
  save. A change that touches only unsampled elements is seen by the
  version counter alone. On an accelerator the sample is gathered on the
  device, queued after the work before the call (the call does not wait
  for it), and compared at the fence, inside the device's capture guard
  (:meth:`~shardpoint.device.Device.capture_guard`), since the fence may be
  checked on a worker thread while the training thread captures a graph.

Example::

    guard = SnapshotGuard.record(step_updates(state).live(ctx))
    ...  # the copy runs; the loop reaches the fence
    err = guard.check("ckpt/step_100")   # None, or a TornSnapshotError to raise
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from ..device import CpuDevice, Device
from ..errors import TornSnapshotError

__all__ = ["SnapshotGuard", "GuardedTensor", "SAMPLE_ELEMENTS", "FINGERPRINTED", "largest"]

SAMPLE_ELEMENTS = 1024
"""The most elements one tensor's fingerprint samples."""

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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The data a distributed tensor holds on this rank (writes through ``.data`` land there)."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        return to_local()


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """A strided sample of ``t``'s raw bytes, or None where sampling is not cheap and exact.

    On an accelerator the sample is queued on the caller's device queue: no wait here.
    """
    t = _local(t)
    if t.device.type == "meta" or not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    stride = max(1, flat.numel() // SAMPLE_ELEMENTS)
    sample = flat[::stride].clone()
    # Compared as bytes: NaN equals itself, and -0.0 differs from 0.0.
    return sample.view(torch.uint8)


def largest(tensors: Iterable[torch.Tensor], n: int = FINGERPRINTED) -> frozenset[int]:
    """The positions of the ``n`` tensors holding the most elements on this rank: the ones a guard samples.

    Example::

        largest([torch.zeros(3), torch.zeros(9), torch.zeros(1)], 1)  # frozenset({1})
    """
    sizes = [_local(t).numel() for t in tensors]
    return frozenset(heapq.nlargest(n, range(len(sizes)), key=sizes.__getitem__))


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
        pairs = list(tensors)
        names = [n for n, _ in pairs]
        ts = [t for _, t in pairs]
        if sampled is None:
            sampled = largest(ts)
        prints = {i: fp for i in sorted(sampled) if (fp := _fingerprint(ts[i])) is not None}
        return cls(names, ts, [t._version for t in ts], prints, device)

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

    def changed(self) -> list[str]:
        """The names of the watched tensors changed in place since :meth:`record`.

        Example::

            if guard.changed(): ...
        """
        out = []
        with self.device.capture_guard():  # comparing a device sample waits for the device
            for i, (t, v) in enumerate(zip(self.tensors, self.versions)):
                if t._version != v:
                    out.append(self.names[i])
                elif i in self.fingerprints:
                    now = _fingerprint(t)
                    if now is None or not torch.equal(now, self.fingerprints[i]):
                        out.append(self.names[i])
        return out

    def check(self, path: str) -> TornSnapshotError | None:
        """A :class:`TornSnapshotError` naming what changed since :meth:`record`, or None.

        Example::

            err = guard.check("ckpt/step_100")
            if err is not None: raise err
        """
        names = self.changed()
        if not names:
            return None
        shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
        more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
        return TornSnapshotError(
            f"the lazy save to {path} was abandoned: {shown}{more} changed in place after async_save() returned "
            f"and before the snapshot's fence, so the checkpoint would hold a state that never existed. "
            f"Nothing was committed; the previous checkpoint at the path is intact. Lazy mode copies parameters "
            f"and optimizer state in the background until the next optimizer.step(): call handle.fence() before "
            f"changing them anywhere else (an EMA, a clamp, manual weight decay, touching optimizer moments), "
            f"or save with mode='eager'.",
            names,
        )
