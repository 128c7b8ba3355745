"""``python -m shardpoint.testing TARGET WORLD ARGS_FILE OUTDIR``: the process :func:`launch` starts."""

import sys

from .launcher import launcher_main

if __name__ == "__main__":
    launcher_main(sys.argv[1:])
