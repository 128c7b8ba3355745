"""The order an asynchronous save copies its tensors in, and which watched tensors its guard samples.

A lazy save copies the tensors a step updates after the call returns, in
the order the step updates them (each parameter, then its state), so the
step waits as little as possible; the eager rest is copied first, at the
call. Its guard watches the live tensors the steps update, and samples the
largest of them. Finding both sizes and sorts every tensor of the state,
which on a sharded model means asking each distributed tensor for its local
shard: thousands of calls, at every save.

Between two checkpoints of one run nothing of that changes, so a saver keeps
the result under the one reuse rule (:mod:`shardpoint.saving.reuse`): its
fingerprint is the save plan it was made from (by identity: a reused plan
holds the very same tensors), whether the lazy part is copied lazily, and
the live tensors, which it holds: found again only where a stepped entry's
part was made anew (see the slot's fingerprint in :mod:`shardpoint.saving.reuse`;
with them, the bytes to copy and the device they are on, facts of the same
tensors). The order and the samples only
make the save faster and its guard sharper; what is copied and what is
checked at the fence is the same with any order.

Example::

    order = copy_order(plan.mine, {"model.w"}, live)
    items, split = order.items, order.split
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..device.tensors import devices_of
from ..engine.snapshot_guard import Watch
from ..engine.staging import optimizer_order
from ..items import SaveTensor

__all__ = ["CopyOrder", "copy_order"]


@dataclass(frozen=True)
class CopyOrder:
    """What one save copies, in order: ``items[:split]`` at the call, the rest lazily; ``watch``: what its guard watches.

    ``watch`` holds the live tensors the steps update, in their order, and
    the positions among them the guard samples;
    ``lazy`` the names copied lazily wherever they are written (replica
    digests of them wait for the lazy worker too);
    ``nbytes`` and ``eager_nbytes`` count all items and the first ``split``;
    ``where`` is the device of the first item not in host memory (else the host),
    ``devices`` every device the items are on (empty: all on the host).

    Example::

        CopyOrder((a, b), 1, Watch.of([("b", b)])).items[1]  # copied lazily
    """

    items: tuple[SaveTensor, ...]
    split: int
    watch: Watch = Watch()
    lazy: frozenset[str] = frozenset()
    nbytes: int = 0
    eager_nbytes: int = 0
    where: torch.device = torch.device("cpu")
    devices: tuple[torch.device, ...] = ()


def copy_order(mine: Sequence[SaveTensor], lazy: set[str] | frozenset[str],
               live: Sequence[tuple[str, torch.Tensor]], steady: bool = False) -> CopyOrder:
    """This rank's items with the ``lazy`` names last, in the order the steps update ``live``.

    ``steady``: the order is kept only while every live tensor keeps its
    storage, shape and strides, so its guard's sample views are made once
    (:meth:`~shardpoint.engine.snapshot_guard.Watch.steady`).

    Example::

        copy_order([w_item, b_item], {"model.w"}, [("model.w", w)]).split  # 1
    """
    later = [t for t in mine if t.fqn in lazy]
    if later:
        later = optimizer_order(later, [t for _, t in live])
    items = tuple([t for t in mine if t.fqn not in lazy] + later)
    split = len(items) - len(later)
    sizes = [t.nbytes for t in items]
    devices = devices_of(t.data for t in items)
    watch = Watch.of(live)
    return CopyOrder(items, split, watch.steady() if steady else watch, frozenset(lazy), sum(sizes), sum(sizes[:split]),
                     devices[0] if devices else torch.device("cpu"), devices)
