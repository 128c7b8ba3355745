"""Plug shardpoint into training frameworks: Lightning, torchtitan, Accelerate and the HF Trainer.

Each framework has one small module here. None of them is imported by
``import shardpoint``; importing a module whose framework is not installed
raises :class:`~shardpoint.errors.MissingDependencyError` (an ``ImportError``)
that says what to install.

Example::

    from shardpoint.integrations.lightning import ShardpointCheckpointIO
    trainer = lightning.Trainer(plugins=[ShardpointCheckpointIO()])
"""

__all__: list[str] = []
