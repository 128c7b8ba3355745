"""Internal: the engine executes plans: data-file writes, the staging ring, reads and the path claim.

Nothing here decides what to save or load; planning does, and adapters
supply the tensors. See the submodules for the public names.
"""

__all__: list[str] = []
