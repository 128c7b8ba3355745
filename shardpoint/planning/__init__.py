"""Pure planners: no processes, no I/O. Manifests and geometry in, frozen plans out."""

from .load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads
from .save_plan import ReplicaItem, assign_writers

__all__ = ["ReadOp", "SourceIndex", "plan_reads", "coverage_gaps", "ReplicaItem", "assign_writers"]
