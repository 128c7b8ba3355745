"""Helpers for tests, examples and benchmarks: a tiny GPT, layouts, a rank launcher.

``TinyGPT`` is a small but real transformer (embedding, attention, MLP, layer
norm, optional tied head). :func:`build` puts it under a named layout on the
current process group. :func:`launch` runs ``module:function`` on ``world``
ranks as real processes on gloo, bound to 127.0.0.1; a fresh launcher process
forks the ranks, which is many times cheaper than spawning each one.

Example::

    results = launch(4, "tests.dist.cases:save_job", {"root": "/tmp/x"})
"""

from .gpt import MLP, Attention, Block, GPTConfig, TinyGPT, batch, loss_of
from .launcher import LaunchError, flip_byte, launch
from .parallel import LAYOUTS, PP_LAYOUTS, GPTStage, build, full_state, replica_ranks, stage_layers, train_step

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "GPTStage",
    "LAYOUTS",
    "PP_LAYOUTS",
    "replica_ranks",
    "build",
    "batch",
    "train_step",
    "full_state",
    "launch",
    "LaunchError",
    "flip_byte",
    "Attention",
    "MLP",
    "Block",
    "loss_of",
    "stage_layers",
]
