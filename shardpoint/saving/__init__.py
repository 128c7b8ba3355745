"""Internal: the save transaction: one save as named phases, run by :func:`shardpoint.save` and the asynchronous saver.

See :mod:`shardpoint.saving.transaction` for the phases,
:mod:`shardpoint.saving.background` for how an asynchronous save schedules
them, :mod:`shardpoint.saving.options` for their keyword-only options,
:mod:`shardpoint.saving.prepare` for the prepare phase (which makes the
frozen :class:`~shardpoint.planning.save_plan.SavePlan` the later phases
take), :mod:`shardpoint.saving.reuse` for what repeated saves reuse,
:mod:`shardpoint.saving.agree` for every collective before the write,
:mod:`shardpoint.saving.steps` for what the other phases call,
:mod:`shardpoint.saving.replicas` for the replica check, and
:mod:`shardpoint.saving.async_save` and :mod:`shardpoint.saving.handle` for
the asynchronous saver and its handle.
"""

from __future__ import annotations

from .transaction import SaveOptions, SaveTransaction, check_state

__all__ = ["SaveTransaction", "SaveOptions", "check_state"]
