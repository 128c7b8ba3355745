"""Internal: pure planners: no processes, no I/O. Manifests and geometry in, frozen plans out.

``writers``: who writes each replicated chunk; ``describe``: a rank's typed
description of what it saved; ``commit``: rank descriptions to a manifest;
``load_plan``: which saved pieces fill each target.
"""

from .commit import AskFor, Documents, assemble_manifest, representatives
from .describe import CandidateGrids, Description, RankReport, RankStatus, TensorsDoc, ValuesDoc
from .load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads
from .writers import ReplicaItem, WriterChoice, assign_writers, choose_writers

__all__ = [
    "ReadOp", "SourceIndex", "plan_reads", "coverage_gaps", "ReplicaItem", "assign_writers", "WriterChoice", "choose_writers",
    "CandidateGrids", "Description", "RankReport", "RankStatus", "TensorsDoc", "ValuesDoc",
    "AskFor", "Documents", "assemble_manifest", "representatives",
]
