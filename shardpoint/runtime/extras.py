"""Optional packages, imported when a feature first needs them.

The core of shardpoint (save, load, async saves, the manager, local and
in-memory storage) installs with torch, numpy, xxhash, fsspec and psutil
only. Corner features take their packages from extras, so an install beside
an existing training stack pulls in nothing it does not use:

=========== ============================== ==========================================
extra       packages                       needed by
=========== ============================== ==========================================
``cli``     rich, tqdm                     the ``shardpoint`` command's tables and progress
``hf``      safetensors                    ``import_hf`` (``export_hf`` writes safetensors itself)
``s3``      boto3                          ``s3://`` paths
``plot``    matplotlib                     ``shardpoint inspect --plot``
=========== ============================== ==========================================

``pip install 'shardpoint[all]'`` installs all four. A missing package raises
:class:`~shardpoint.errors.MissingDependencyError` naming the command that
installs it.

Example::

    from shardpoint.runtime.extras import require
    safetensors = require("safetensors", "hf", "importing safetensors files")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import MissingDependencyError

__all__ = ["require", "EXTRAS"]

EXTRAS = {"cli": ("rich", "tqdm"), "hf": ("safetensors",), "s3": ("boto3",), "plot": ("matplotlib",)}
"""Each extra and the packages it installs."""


def require(module: str, extra: str, feature: str, install: str = "", package: str = "") -> ModuleType:
    """Import ``module`` for ``feature``, or raise a typed error that says how to install it.

    The command named is ``pip install 'shardpoint[<extra>]'``, or ``install``
    when a package needs more than an extra (torchtitan goes in with
    ``--no-deps``). The error's ``package`` (``package``, else the module's
    top-level name) and ``hint`` attributes carry the missing distribution
    and that command.

    Example::

        tqdm = require("tqdm", "cli", "progress bars").tqdm
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module.split(".")[0]
        hint = install or f"pip install 'shardpoint[{extra}]'"
        raise MissingDependencyError(
            f"{feature} needs the package {package!r}, which is not installed ({e}); install it with: {hint}",
            package=package,
            hint=hint,
        ) from None
