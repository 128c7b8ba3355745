"""Layout rules: stored tensors as views of logical tensors (see :mod:`shardpoint.layouts.apply`)."""

from .apply import *  # noqa: F403
from .apply import __all__
