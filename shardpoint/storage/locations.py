"""Locations relative to each other: how an incremental checkpoint names its base (``../step_100``).

A storage says where it lies with :meth:`~shardpoint.storage.base.Storage.place`
(a namespace and an absolute POSIX path) and opens another place of its tree
with :meth:`~shardpoint.storage.base.Storage.at`; these two functions build
the relative names on them.

Example::

    rel = relative_location(run.child("step_2"), run.child("step_1"))   # '../step_1'
    base = locate(run.child("step_2"), rel)
"""

from __future__ import annotations

import posixpath

from ..errors import StorageError
from .base import Storage

__all__ = ["relative_location", "locate"]


def relative_location(here: Storage, other: Storage) -> str | None:
    """``other``'s location relative to ``here`` (``../step_1``), or ``None`` when they lie in different trees.

    Example::

        relative_location(LocalStorage("/ckpt/step_2"), LocalStorage("/ckpt/step_1"))   # '../step_1'
    """
    a, b = here.place(), other.place()
    return None if a is None or b is None or a[0] != b[0] else posixpath.relpath(b[1], a[1])


def locate(here: Storage, rel: str) -> Storage:
    """The storage at location ``rel`` relative to ``here``.

    Example::

        locate(LocalStorage("/ckpt/step_2"), "../step_1").url   # '/ckpt/step_1'
    """
    place = here.place()
    if place is None:
        raise StorageError(f"{here.url}: {type(here).__name__} cannot locate {rel!r} relative to itself")
    return here.at(posixpath.normpath(posixpath.join(place[1], rel)))
