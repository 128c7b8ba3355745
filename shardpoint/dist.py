"""Process-group helpers that also work with no process group at all.

Every collective shardpoint runs goes through :class:`Comm`. With no
initialised process group (the CLI, unit tests, one-process jobs) it is a
world of one and each collective is the identity, so the same code path runs
everywhere. Errors are aggregated: :meth:`Comm.check` gathers each rank's
outcome and raises the same typed error on every rank, so one failing rank
never leaves the others hanging.
"""

from __future__ import annotations

import atexit
import logging
import traceback
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from . import errors as _errors
from .errors import CheckpointError, DistributedError

if TYPE_CHECKING:
    from .runtime.handshake import Ticket

__all__ = ["Comm", "Outcome", "run_guarded", "LocalGroup", "LOCAL", "private_group", "destroy_private_group", "close_at_exit"]

log = logging.getLogger("shardpoint")
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """A rank's result, or the class name and message of what it raised."""

    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    exc: Any = field(default=None, compare=False, repr=False)
    attrs: dict | None = None  # picklable extras of the error (e.g. missing/unexpected keys)

    def sendable(self, with_value: bool = True) -> "Outcome":
        """A copy without the live exception object, fit to send to other ranks."""
        return Outcome(self.ok, self.value if with_value else None, self.error_type, self.message, None, self.attrs)


def run_guarded(fn: Callable[[], T]) -> Outcome:
    """Run ``fn`` and capture any exception as a picklable :class:`Outcome`."""
    try:
        return Outcome(True, fn())
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        log.debug("local failure: %s", traceback.format_exc())
        attrs = {k: list(getattr(e, k)) for k in ("missing", "unexpected", "tensors", "groups") if isinstance(getattr(e, k, None), list)}
        if isinstance(getattr(e, "tensor", None), str):
            attrs["tensor"] = e.tensor
        return Outcome(False, None, type(e).__name__, str(e), e, attrs or None)


@dataclass(frozen=True)
class LocalGroup:
    """The type of :data:`LOCAL`: "this rank alone", as a ``process_group`` argument.

    Pass :data:`LOCAL` (the one instance) rather than creating others.
    """

    def __repr__(self) -> str:
        return "shardpoint.LOCAL"


LOCAL = LocalGroup()
"""``process_group=sp.LOCAL`` runs a save, load or async save on the calling rank alone.

No collective runs, even when a default process group exists, so one rank
can save while the others are elsewhere (Lightning calls a checkpoint
plugin's ``save_checkpoint`` on global rank 0 only under DDP). The state must
be complete on this rank: plain tensors, and DTensors that are replicated
over their mesh (saved from this rank's full copy). A DTensor sharded across
ranks, or an FSDP1/ZeRO flat shard, raises
:class:`~shardpoint.errors.UnsupportedStateError` naming it. A load with
``LOCAL`` fills this rank's tensors (for a DTensor, its own shard) from the
checkpoint, reading only what it needs.

Example::

    if rank == 0:
        sp.save("ckpt/step_100", {"model": ddp_model.module, "extra": {"step": 100}}, process_group=sp.LOCAL)
"""


class Comm:
    """The ranks taking part in one save or load.

    ``local`` marks a world of one chosen with :data:`LOCAL` while other ranks
    may exist (the state must then be complete on this rank).

    Example::

        comm = Comm.resolve(None)      # default group, or a world of one
        comm.rank, comm.world
    """

    local = False

    def __init__(self, group: Any = None, active: bool = False, local: bool = False):
        self.group = group
        self.active = active
        self.local = local
        self.rank = dist.get_rank(group) if active else 0
        self.world = dist.get_world_size(group) if active else 1

    @staticmethod
    def resolve(process_group: Any = None) -> "Comm":
        """Use ``process_group``, else the default group when initialised, else a world of one.

        :data:`LOCAL` gives a world of one even when a default group exists.
        """
        if isinstance(process_group, LocalGroup):
            return Comm(None, False, local=True)
        if process_group is not None:
            if dist.is_available() and dist.is_initialized() and dist.get_rank(process_group) < 0:
                raise ValueError(
                    f"rank {dist.get_rank()} is not a member of the process_group passed; only the group's "
                    "ranks take part in the call (use process_group=sp.LOCAL for this rank alone)"
                )
            return Comm(process_group, True)
        if dist.is_available() and dist.is_initialized():
            return Comm(None, True)
        return Comm(None, False)

    def enter(self, op: str, path: str, timeout: float | None = None) -> None:
        """Check that every rank of the group entered the same ``op`` on ``path`` (see :mod:`shardpoint.runtime.handshake`).

        Raises :class:`DistributedError` on disagreement, or when a rank does
        not arrive within ``timeout`` seconds (``None``: the environment or
        the default). Free in a world of one.
        """
        self.announce(op, path, timeout).wait()

    def announce(self, op: str, path: str, timeout: float | None = None, later: bool = False) -> Ticket:
        """Post this rank's entry into ``op`` on ``path`` without waiting for the others; the ticket's ``wait()`` is :meth:`enter`'s wait.

        An asynchronous save (``later=True``) only hands its entry to the
        process's posting thread, and waits for the other ranks in the
        background, before its first exchange with them. Where the group has
        no store to wait on, the ranks exchange their entries now (a
        collective) and the ticket has nothing left to wait for.

        Example::

            ticket = comm.announce("async_save", "file:///ck", later=True); ...; ticket.wait()
        """
        from .runtime.handshake import Entry, Ticket, collective_timeout, mismatch_message, post

        if not self.active or self.world == 1:
            return Ticket()
        entry = Entry(op, path)
        seconds = collective_timeout(timeout)
        store = _group_store(self.group)
        if store is not None:
            return post(store, self.rank, self.world, entry, seconds, wait=not later)
        # No store to wait on with a timeout: still name a disagreement, without one.
        tags = self.all_gather(entry.tag())
        for r, t in enumerate(tags):
            if t != tags[0]:
                raise DistributedError(mismatch_message(entry, self.rank, Entry.parse(tags[0]), r, Entry.parse(t)), {r: t})
        return Ticket()

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank ``group_rank`` (the same number without a group).

        Not a collective. Replica groups and copy names speak of global ranks.

        Example::

            comm.global_rank(comm.rank)
        """
        return self._global(group_rank)

    def group_ranks(self, ranks: "Sequence[int]") -> "tuple[int, ...] | None":
        """``ranks`` (global ranks) as ranks of this group; ``None`` if one lies outside it.

        Not a collective. DTensor meshes and ``replicated_over`` name global ranks.
        """
        if self.group is None:
            return tuple(ranks)
        try:
            return tuple(dist.get_group_rank(self.group, r) for r in ranks)
        except (ValueError, RuntimeError):
            return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from group rank ``src`` on every rank."""
        if not self.active or self.world == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """A list of every rank's ``obj`` on ``dst``; ``None`` elsewhere."""
        if not self.active or self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_rows(self, rows: "torch.Tensor") -> list["torch.Tensor"]:
        """Every rank's int64 ``[n, k]`` table (``n`` may differ per rank), as tensors.

        Tensors instead of pickled objects: no per-row Python objects on the wire.
        """
        if not self.active or self.world == 1:
            return [rows]
        k = rows.shape[1]
        n = torch.tensor([rows.shape[0]], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, n, group=self.group)
        most = max(int(c) for c in counts)
        padded = torch.zeros((most, k), dtype=torch.int64)
        padded[: rows.shape[0]] = rows
        out = [torch.empty((most, k), dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return [o[: int(c)] for o, c in zip(out, counts)]

    def all_to_all_rows(self, parts: "list[torch.Tensor]", k: int) -> list["torch.Tensor"]:
        """Send ``parts[q]`` (an int64 ``[n_q, k]`` table) to rank ``q``; return what each rank sent here.

        Two ``all_to_all_single`` calls (the row counts, then the rows), so a
        rank receives only the rows addressed to it: unlike
        :meth:`all_gather_rows`, nothing grows with world size x rows per rank.
        """
        if not self.active or self.world == 1:
            return [parts[0].reshape(-1, k)]
        send_counts = torch.tensor([int(p.shape[0]) for p in parts], dtype=torch.int64)
        recv_counts = torch.empty(self.world, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        flat_in = torch.cat([p.reshape(-1, k) for p in parts]).reshape(-1).contiguous()
        rc = [int(c) * k for c in recv_counts]
        flat_out = torch.empty(sum(rc), dtype=torch.int64)
        dist.all_to_all_single(flat_out, flat_in, rc, [int(c) * k for c in send_counts], group=self.group)
        return list(flat_out.reshape(-1, k).split([c // k for c in rc]))

    def isend(self, tensor: "torch.Tensor", dst: int, tag: int = 0) -> Any:
        """Start sending ``tensor`` to group rank ``dst``; returns a handle whose ``wait()`` ends it."""
        return dist.isend(tensor, dst=self._global(dst), group=self.group, tag=tag)

    def irecv(self, tensor: "torch.Tensor", src: int, tag: int = 0) -> Any:
        """Start receiving into ``tensor`` from group rank ``src``; returns a handle whose ``wait()`` ends it."""
        return dist.irecv(tensor, src=self._global(src), group=self.group, tag=tag)

    def send(self, tensor: "torch.Tensor", dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to group rank ``dst`` and wait until it is sent."""
        dist.send(tensor, dst=self._global(dst), group=self.group, tag=tag)

    def recv_any(self, tensor: "torch.Tensor") -> int:
        """Receive into ``tensor`` from whichever rank sends first; returns the sender's group rank."""
        sender = dist.recv(tensor, src=None, group=self.group)
        return sender if self.group is None else dist.get_group_rank(self.group, sender)

    def all_reduce(self, tensor: "torch.Tensor", op: str = "sum") -> "torch.Tensor":
        """Reduce ``tensor`` in place over the group (``op``: ``"sum"`` or ``"max"``) and return it."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
        if self.active and self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.active and self.world > 1:
            dist.barrier(group=self.group)

    def check(self, outcome: Outcome, what: str) -> Any:
        """All-gather outcomes; raise one aggregated error on every rank if any failed."""
        if not self.active or self.world == 1:
            if not outcome.ok and outcome.exc is not None:
                raise outcome.exc
        outcomes = self.all_gather(outcome.sendable(with_value=False))
        raise_if_failed(outcomes, what)
        if not outcome.ok:  # pragma: no cover - raise_if_failed already raised
            raise DistributedError(outcome.message, {self.rank: outcome.message})
        return outcome.value


def private_group(base: Comm, timeout: float | None = None) -> Comm:
    """A new gloo group over ``base``'s ranks, for background or bounded collectives.

    Creating a group is itself a collective. Over the whole world every rank
    must call ``new_group``. For a subset the other ranks take no part in
    the caller's work, so the members create it alone
    (``use_local_synchronization=True``: torch names such a group from its
    ranks and the number of groups each member has made, which is equal on
    the members as long as they create groups in the same order). A world of
    one needs no group and gets ``base`` back.

    Example::

        coord = private_group(Comm.resolve(dp_group), timeout=300)
    """
    if not base.active or base.world == 1:
        return base
    import datetime

    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if base.group is None:
        return Comm(dist.new_group(backend="gloo", **kw), True)
    ranks = sorted(dist.get_process_group_ranks(base.group))
    if len(ranks) == dist.get_world_size():
        return Comm(dist.new_group(ranks=ranks, backend="gloo", **kw), True)
    return Comm(dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True, **kw), True)


def _group_store(group: Any):
    """The key-value store of ``group`` (``None``: the default group), or ``None`` where torch hides it."""
    try:
        from torch.distributed import distributed_c10d as c10d

        if group is None:
            return c10d._get_default_store()
        return c10d._get_process_group_store(group)
    except (AttributeError, KeyError, ValueError, RuntimeError):  # another torch, or a backend without a store
        return None


def raise_if_failed(outcomes: list[Outcome], what: str) -> None:
    """Raise one typed error naming every failing rank, if any outcome failed."""
    failed = {r: o for r, o in enumerate(outcomes) if not o.ok}
    if not failed:
        return
    causes = {r: f"{o.error_type}: {o.message}" for r, o in failed.items()}
    first = next(iter(failed.values()))
    cls = getattr(_errors, first.error_type, None)
    if len(outcomes) == 1:
        detail = first.message
    else:
        detail = first.message + "".join(
            f"\n  rank {r}: {c}" for r, c in sorted(causes.items())
        )
        detail = f"{what} failed on rank(s) {sorted(failed)}: {detail}"
    if isinstance(cls, type) and issubclass(cls, CheckpointError) and cls is not DistributedError:
        try:
            err = cls(detail)
        except TypeError:
            err = DistributedError(detail, causes, cls)
        err.causes = causes  # type: ignore[attr-defined]
        for k, v in (first.attrs or {}).items():
            setattr(err, k, v)
        raise err
    raise DistributedError(f"{what} failed: {detail}", causes, cls if isinstance(cls, type) else None)


def destroy_private_group(comm: "Comm | None") -> None:
    """Destroy a private gloo group that shardpoint created, while the interpreter is still alive.

    A gloo group left to interpreter shutdown is freed during finalisation;
    its worker threads may then still release tensors of their last
    collective, which needs the GIL, and a thread that asks for the GIL
    during finalisation is ended with a forced unwind through C++ frames:
    ``terminate called without an active exception`` and SIGABRT, after
    all Python work finished. Destroying the group here (a local call, no
    collective) joins those threads first. A group already destroyed along
    with the default group is only released.

    Example::

        destroy_private_group(self._comm); self._comm = None
    """
    if comm is None or comm.group is None or not comm.active:
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group(comm.group)
    except (ValueError, RuntimeError, AssertionError) as e:  # destroyed already with the default group
        log.debug("private process group already destroyed: %s", e)


def close_at_exit(close: Callable[[], None]) -> None:
    """Call the bound method ``close`` at interpreter exit, unless its object is gone by then.

    Owners of threads and private process groups register their ``close``
    so that both are finished before finalisation (see
    :func:`destroy_private_group`); the hook holds only a weak reference,
    so it never keeps the owner alive.

    Example::

        close_at_exit(self.close)
    """
    ref = weakref.WeakMethod(close)

    def hook() -> None:
        fn = ref()
        if fn is None:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - exiting anyway; never turn an exit into a crash
            log.warning("shardpoint: cleanup at exit failed: %s", e)

    atexit.register(hook)
