"""Resumable data order for map-style datasets, sharded by data-parallel rank.

:class:`ResumableSampler` is a ``torch.utils.data.Sampler`` whose state is
*global*: the epoch, the seed, and how many samples of the epoch's
permutation all data-parallel ranks together have consumed (``position``).
Nothing in it depends on the rank or on the number of ranks, so a checkpoint
taken on 4 ranks resumes on 2 (or 3, or 1) at the same global position, and
within the epoch no sample is lost or repeated.

The order of an epoch is a permutation ``P`` of ``range(len(dataset))``,
fixed by ``(seed, epoch)``. From a position ``c`` onward, with ``W`` ranks,
rank ``r`` takes ``P[c + r], P[c + r + W], P[c + r + 2W], ...`` (interleaved,
like ``DistributedSampler``). All ranks consume in lockstep, so after each
rank has consumed ``n`` samples the global position is ``c + n * W`` and the
consumed samples are exactly ``P[c : c + n * W]``, whatever the per-rank batch
size. A resumed run starts again from its restored ``c``, with its own ``W``.

**The tail.** When the ``R`` samples left in the epoch are not a multiple of
``W``:

* ``drop_last=False`` (the default, "pad"): every rank takes ``ceil(R / W)``
  samples; the ``(-R) % W`` missing slots at the end repeat the first samples
  of the epoch's permutation (``P[0], P[1], ...``). Every sample is seen, and
  at most ``W - 1`` are seen twice, all in the last step.
* ``drop_last=True``: every rank takes ``R // W`` samples; the last ``R % W``
  samples of the permutation are skipped for this epoch. No sample is seen
  twice.

Either way every rank gets the same number of samples, so ranks stay in
lockstep (no rank waits in a collective for a batch that never comes). Which
samples pad or drop depends on ``W`` at the time the tail is reached.

**Counting what was consumed.** A ``DataLoader`` pulls indices from its
sampler before it hands the batches out: with ``num_workers > 0`` it
prefetches ``prefetch_factor * num_workers`` batches. So the sampler cannot
know from the indices it has yielded which samples the training loop has
actually used. Two supported ways:

* Wrap the loader in :class:`ResumableLoader` (recommended, any
  ``num_workers``): it counts the batches it has *handed to you*; a batch
  counts as consumed as soon as you receive it. Checkpoint
  the loader (or its sampler) after the step that used the batch.
* Use the sampler directly in a ``DataLoader`` with ``num_workers=0``: then
  the sampler counts the indices it yields, which for a single-process loader
  are exactly the indices of the batches handed out so far.
  (Or set ``count_on_yield=False`` and call :meth:`ResumableSampler.advance`
  yourself from the loop.)

**Epochs.** Iterating resumes from the current position, not from the start
of the epoch; an iteration that runs to its end moves to the next epoch
(``epoch + 1``, position 0). :meth:`ResumableSampler.set_epoch` with a
*different* epoch starts that epoch from its beginning and with the *current*
epoch is a no-op, so the usual ``for epoch in range(start, E):
sampler.set_epoch(epoch)`` loop works after a resume.

**Checkpointing.** ``state_dict()`` holds only plain values that are the
same on every rank, so ``sp.save`` stores it in the manifest (written from
rank 0) and ``sp.load`` gives every rank the same state::

    sampler = ResumableSampler(dataset, seed=0)          # rank/world from torch.distributed
    loader = ResumableLoader(DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2))
    sp.load("ckpt/last", {"data": loader, ...})          # if resuming
    for batch in loader:
        train_step(batch)
        if time_to_save:
            sp.save("ckpt/last", {"data": loader, ...})

The permutation comes from NumPy's legacy ``RandomState`` (whose stream NumPy
guarantees to keep stable across versions), seeded with ``(seed, epoch)``.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["ResumableSampler", "ResumableLoader", "epoch_permutation", "STATE_VERSION"]

STATE_VERSION = 1
_U32 = 0xFFFFFFFF


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global order of one epoch: a permutation of ``range(num_samples)`` (int64).

    Depends only on its arguments; the same on every rank, every process and
    every NumPy version (it uses the legacy ``RandomState`` stream).

    Example::

        >>> epoch_permutation(5, seed=0, epoch=0, shuffle=False).tolist()
        [0, 1, 2, 3, 4]
        >>> sorted(epoch_permutation(5, seed=0, epoch=1).tolist())
        [0, 1, 2, 3, 4]
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    key = np.array([seed & _U32, (seed >> 32) & _U32, epoch & _U32, (epoch >> 32) & _U32], dtype=np.uint32)
    return np.random.RandomState(key).permutation(num_samples).astype(np.int64, copy=False)


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[int]):
    """A data-parallel sampler with a global, resharding state (see the module docs).

    ``data_source`` is a sized dataset or its length. ``rank``/``world_size``
    are this rank's place among the data-parallel ranks (default: the
    default process group, or ``(0, 1)`` without one); with tensor or
    pipeline parallelism pass the data-parallel rank and size, not the
    global ones. ``seed`` and ``shuffle`` fix the order; ``drop_last``
    chooses the tail policy. With ``count_on_yield`` (the default) every
    yielded index counts as consumed, which is exact for a ``DataLoader`` with
    ``num_workers=0``; :class:`ResumableLoader` turns it off and counts
    delivered batches instead.

    ``state_dict()`` is ``{"version", "epoch", "seed", "shuffle",
    "num_samples", "position", "world_size", "drop_last"}``: plain values,
    identical on every rank, so ``sp.save`` keeps them in the manifest
    (from rank 0). ``world_size`` and ``drop_last`` are informative; loading
    restores ``epoch``, ``seed``, ``shuffle`` and ``position`` and checks
    ``num_samples``.

    Example::

        >>> s = ResumableSampler(10, rank=1, world_size=2, shuffle=False)
        >>> it = iter(s); [next(it) for _ in range(2)]
        [1, 3]
        >>> s.state_dict()["position"]        # 2 samples on each of 2 ranks
        4
        >>> t = ResumableSampler(10, rank=0, world_size=3, shuffle=False)
        >>> t.load_state_dict(s.state_dict()); list(t)   # resume on 3 ranks
        [4, 7]
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        count_on_yield: bool = True,
    ) -> None:
        n = data_source if isinstance(data_source, int) else len(data_source)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        if rank is None:
            rank, world_size = _dist_rank_world()
        assert world_size is not None
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self.num_samples = int(n)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.count_on_yield = bool(count_on_yield)
        self.epoch = 0
        self._base = 0  # global position where the current iteration started
        self._local = 0  # this rank's samples consumed since then
        self._perm_key: tuple | None = None
        self._perm: np.ndarray | None = None

    # ------------------------------------------------------------ arithmetic
    def _count(self, base: int) -> int:
        """Samples each rank takes from global position ``base`` to the end of the epoch."""
        left = max(0, self.num_samples - base)
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    @property
    def position(self) -> int:
        """Global samples of this epoch consumed by all ranks together (``0..num_samples``).

        Once this rank has consumed the last sample it gets this epoch, the
        position is ``num_samples`` (whatever was dropped or padded). Samples
        that ``drop_last`` would skip at this world size keep their place
        until an iteration actually ends the epoch, so a resume on fewer ranks
        can still use them.
        """
        n = self._count(self._base)
        if n and self._local >= n:
            return self.num_samples
        return self._base + self._local * self.world_size

    def local_remaining(self) -> int:
        """How many indices this rank gets from the current position to the end of the epoch."""
        return self._count(self.position)

    def __len__(self) -> int:
        """Indices a fresh iteration yields now: the rest of the epoch for this rank."""
        return self.local_remaining()

    def _permutation(self) -> np.ndarray:
        key = (self.num_samples, self.seed, self.epoch, self.shuffle)
        if self._perm_key != key:
            self._perm = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
            self._perm_key = key
        assert self._perm is not None
        return self._perm

    def indices(self, base: int | None = None) -> list[int]:
        """This rank's indices from global position ``base`` (default: now) to the epoch's end.

        Example::

            >>> ResumableSampler(5, rank=0, world_size=2, shuffle=False).indices()
            [0, 2, 4]
            >>> ResumableSampler(5, rank=1, world_size=2, shuffle=False).indices()   # padded
            [1, 3, 0]
        """
        base = self.position if base is None else base
        n = self._count(base)
        if n == 0:
            return []
        perm = self._permutation()
        q = base + self.rank + self.world_size * np.arange(n, dtype=np.int64)
        over = q >= self.num_samples  # padding: repeat the epoch's first samples
        q[over] = (q[over] - self.num_samples) % self.num_samples
        return perm[q].tolist()

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[int]:
        self._rebase()
        order = self.indices(self._base)
        return self._iterate(order) if self.count_on_yield else iter(order)

    def _iterate(self, order: list[int]) -> Iterator[int]:
        epoch = self.epoch
        for i in order:
            self._local += 1  # counted when handed out: a batch holding it is then complete
            yield i
        if self.epoch == epoch:
            self.end_epoch()

    def _rebase(self) -> None:
        self._base, self._local = self.position, 0

    def advance(self, num_samples: int) -> None:
        """Mark ``num_samples`` more of *this rank's* samples consumed (all ranks do the same).

        For loops that count themselves (``count_on_yield=False``); the global
        position moves by ``num_samples * world_size``.

        Example::

            >>> s = ResumableSampler(100, rank=0, world_size=4, count_on_yield=False)
            >>> s.advance(8); s.position
            32
        """
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self._local += int(num_samples)

    def end_epoch(self) -> None:
        """Move to the start of the next epoch (called when an iteration runs to its end).

        Example::

            >>> s = ResumableSampler(4, rank=0, world_size=1); s.end_epoch(); (s.epoch, s.position)
            (1, 0)
        """
        self.epoch += 1
        self._base = self._local = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the current epoch (then keep the position).

        Example::

            >>> s = ResumableSampler(8, rank=0, world_size=1, count_on_yield=False)
            >>> s.advance(3); s.set_epoch(0); s.position      # same epoch: kept
            3
            >>> s.set_epoch(5); (s.epoch, s.position)
            (5, 0)
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._base = self._local = 0

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The global state: plain values, identical on every rank (see the class docs).

        Example::

            >>> ResumableSampler(10, rank=0, world_size=2, seed=7).state_dict()["seed"]
            7
        """
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "position": self.position,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position, with this sampler's rank and world size.

        Raises ``ValueError`` if the dataset length differs (positions would
        mean other samples) or the state is malformed.

        Example::

            >>> a = ResumableSampler(10, rank=0, world_size=4, count_on_yield=False); a.advance(1)
            >>> b = ResumableSampler(10, rank=0, world_size=2); b.load_state_dict(a.state_dict())
            >>> b.position
            4
        """
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"unsupported sampler state version {version!r} (this shardpoint reads {STATE_VERSION})")
        try:
            n, epoch, seed, pos = (int(state[k]) for k in ("num_samples", "epoch", "seed", "position"))
            shuffle = bool(state["shuffle"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed sampler state {state!r}: {e}") from None
        if n != self.num_samples:
            raise ValueError(
                f"the checkpoint's sampler covered {n} samples, this dataset has {self.num_samples}: "
                "positions would refer to other samples"
            )
        if not 0 <= pos <= n or epoch < 0 or not 0 <= seed < 2**64:
            raise ValueError(f"sampler state out of range: {state!r}")
        self.epoch, self.seed, self.shuffle = epoch, seed, shuffle
        self._base, self._local = pos, 0

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(num_samples={self.num_samples}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self.epoch}, position={self.position}, seed={self.seed}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last})"
        )


class ResumableLoader:
    """A ``DataLoader`` over a :class:`ResumableSampler` that counts the batches it hands out.

    Use it with any ``num_workers``: the loader may prefetch indices, but
    only batches you have received count as consumed. The wrapped loader
    must have been built with ``sampler=ResumableSampler(...)`` and a
    ``batch_size`` (not a custom ``batch_sampler``); its ``drop_last`` drops
    a rank's last partial batch, which then counts as consumed at the end of
    the epoch. ``state_dict``/``load_state_dict`` are the sampler's, so the
    loader itself can go into ``sp.save``/``sp.load`` state; its state is
    global and lives in the manifest.

    Iterating yields the rest of the current epoch; an iteration that runs
    to the end moves to the next epoch. Keep one iteration active at a time.

    Example::

        sampler = ResumableSampler(dataset, seed=0)
        loader = ResumableLoader(DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2))
        for epoch in range(loader.epoch, epochs):
            for batch in loader:
                step(batch)
                sp.save(path, {"model": model, "optimizer": opt, "data": loader})
    """

    def __init__(self, loader: DataLoader) -> None:
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"ResumableLoader needs a DataLoader built with sampler=ResumableSampler(...), "
                f"got sampler {type(sampler).__name__}"
            )
        if loader.batch_size is None:
            raise ValueError("ResumableLoader needs a DataLoader with batch_size set (not a custom batch_sampler)")
        self.loader = loader
        self.sampler = sampler
        sampler.count_on_yield = False
        if loader.generator is None:
            # Each iter() of a DataLoader without a generator draws from the global torch
            # generator; a resumed run opens an extra iterator mid-epoch, which would shift the
            # training loop's random stream (dropout) away from the uninterrupted run's.
            loader.generator = torch.Generator().manual_seed(int(sampler.seed))

    @property
    def epoch(self) -> int:
        """The sampler's current epoch."""
        return self.sampler.epoch

    @property
    def batch_size(self) -> int:
        """Per-rank batch size of the wrapped loader."""
        return int(self.loader.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`ResumableSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch on this rank."""
        n, b = self.sampler.local_remaining(), self.batch_size
        return n // b if self.loader.drop_last else math.ceil(n / b)

    def __iter__(self) -> Iterator[Any]:
        s, b = self.sampler, self.batch_size
        epoch = s.epoch
        n = s.local_remaining()
        done = 0
        for batch in self.loader:
            k = min(b, n - done)
            done += k
            s.advance(k)  # handed to the caller: consumed
            yield batch
        if s.epoch == epoch:
            s.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's global state (plain values; see :meth:`ResumableSampler.state_dict`)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position (see :meth:`ResumableSampler.load_state_dict`)."""
        self.sampler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ResumableLoader({self.sampler!r}, batch_size={self.batch_size})"
