"""What a save did on one rank: :class:`SaveResult`.

Example::

    result = SaveResult("ckpt/step_100", save_id); result.timings
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.monitor import Recorder

__all__ = ["SaveResult"]


@dataclass
class SaveResult:
    """What a save did on this rank: phase timings (seconds) and bytes written.

    ``plan_cached`` says one thing: this save reused the writer choice of
    an earlier save of the same saver (its tensors had the same names,
    shapes, dtypes and geometry), so no writers were chosen again. It is
    ``False`` for the first save and for :func:`shardpoint.save`, which
    keeps nothing between calls. ``bytes_referenced`` counts the chunk
    bytes an incremental save (``base=``) referenced instead of writing.

    Example::

        result = sp.save("ckpt/step_100", state); result.timings["commit"]
    """

    path: str
    save_id: str
    bytes_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    recorder: Recorder | None = field(default=None, repr=False)
    plan_cached: bool = False
    bytes_referenced: int = 0
