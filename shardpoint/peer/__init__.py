"""Peer-memory checkpoints: host memory on this host and its peers, restored in seconds after a host loss.

- :mod:`.plan`: pure placement, completeness and source selection.
- :mod:`.routed`: a read-only storage serving each file from the hosts holding it,
  falling back chunk by chunk to the next copy.
- :mod:`.serve`: the server thread and client that move a peer's bytes over the process group.
- :mod:`.restore`: loading one complete memory step, phase by phase.
- :mod:`.memory`: :class:`PeerMemory`, which saves, replicates and restores.
"""

from .plan import HostListing, MemoryChoice, StepCopy, Transfer, choose_memory_step, complete_steps, replica_hosts, source_order, transfers
from .routed import RoutedStorage
from .memory import DOMAIN_ENV, HOST_ENV, PeerMemory, RestoreReport, default_memory_dir, host_id

__all__ = [
    "PeerMemory", "RestoreReport", "host_id", "default_memory_dir", "HOST_ENV", "DOMAIN_ENV",
    "RoutedStorage", "HostListing", "StepCopy", "Transfer", "MemoryChoice",
    "replica_hosts", "transfers", "complete_steps", "choose_memory_step", "source_order",
]
