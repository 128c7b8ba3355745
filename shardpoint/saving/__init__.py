"""The save transaction: one save as named phases, run by :func:`shardpoint.save` and the asynchronous saver.

See :mod:`shardpoint.saving.transaction` for the phases and
:mod:`shardpoint.saving.background` for how an asynchronous save schedules them.
"""

from __future__ import annotations

from .transaction import SaveOptions, SaveTransaction, check_state

__all__ = ["SaveTransaction", "SaveOptions", "check_state"]
