"""Internal: the load: one transaction with named phases, and what it reports.

:class:`~shardpoint.loading.transaction.LoadTransaction` runs a load phase
by phase; :func:`shardpoint.load` is the public call that runs it.
``entries.py`` plans each state entry's targets, ``names.py`` selects
names (``keys=``) and suggests fixes for typos, ``diagnose.py`` builds the
load's typed errors, and ``result.py`` holds :class:`LoadResult`, ``options.py`` the
keyword-only :class:`~shardpoint.loading.options.LoadOptions`.
"""

from __future__ import annotations

from .options import LoadOptions
from .result import LoadResult
from .transaction import LoadTransaction, manifest_bytes

__all__ = ["LoadOptions", "LoadResult", "LoadTransaction", "manifest_bytes"]
