"""``python -m shardpoint``: the ``shardpoint`` command (see :mod:`shardpoint.cli`)."""

import sys

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
