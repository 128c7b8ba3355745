"""The arguments of a save that its phases read: :class:`SaveOptions`.

Example::

    SaveOptions(block_size=1 << 20, replicated_over=dp_group)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from ..engine.claim import CommitPolicy
from ..format.datafile import DEFAULT_BLOCK_SIZE

__all__ = ["SaveOptions", "save_options", "take_keywords"]


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """The arguments of a save that its phases read; they mean what they mean for :func:`shardpoint.save`.

    Built by keyword only, so that no call site depends on their order.

    Example::

        SaveOptions(block_size=1 << 20, replicated_over=dp_group)
    """

    allow_pickle: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    layouts: Sequence[Any] = ()
    replicated_over: Any = None
    collective_timeout: float | None = None
    commit: CommitPolicy | None = None
    trace_dir: str | None = None
    on_metrics: Any = None
    base: Any = None  # a committed checkpoint (or a ChosenBase) whose equal chunks are referenced (shardpoint.saving.incremental)



def save_options(call: str, given: Mapping[str, Any]) -> SaveOptions:
    """The :class:`SaveOptions` of the keyword arguments ``given`` to ``call``; an unknown name raises :class:`TypeError`.

    Example::

        save_options("AsyncSaver.save", {"block_size": 1 << 20})
    """
    known = {f.name for f in fields(SaveOptions)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"its save options are {', '.join(sorted(known))}")
    return SaveOptions(**given)


def take_keywords(call: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``given``; a name not in ``defaults`` raises :class:`TypeError` naming the known ones.

    Example::

        take_keywords("AsyncSaver", {"prewarm": False}, {"prewarm": True, "background_nice": 5})
    """
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"it also takes {', '.join(sorted(defaults))}")
    return {**defaults, **given}
