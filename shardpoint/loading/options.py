"""The options of one load, as one keyword-only frozen value.

Example::

    LoadTransaction("ckpt/step_100", state, LoadOptions(strict=False, keys="model")).run()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["LoadOptions"]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Everything :func:`shardpoint.load` passes to a :class:`~shardpoint.loading.LoadTransaction` besides path and state.

    Each field means what the keyword of the same name means for
    :func:`shardpoint.load`; the defaults are that function's defaults.

    Example::

        options = LoadOptions(strict=False, verify=False)
        options.selected  # None: every entry
    """

    process_group: Any = None
    strict: bool = True
    allow_pickle: bool = False
    verify: bool = True
    share_reads: bool | str = "auto"
    keys: str | Sequence[str] | None = None
    layouts: Sequence[Any] = ()
    collective_timeout: float | None = None
    progress: bool = False
    trace_dir: str | None = None
    on_metrics: Any = None
    replicated_over: Any = None

    @property
    def selected(self) -> list[str] | None:
        """The selected keys or patterns as a list, or ``None`` for every entry.

        Example::

            LoadOptions(keys="model").selected  # ["model"]
        """
        if self.keys is None:
            return None
        return [self.keys] if isinstance(self.keys, str) else list(self.keys)
