"""Process-group topology, collectives and the parallel layer implementations."""

from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode

__all__ = ["ParallelContext", "ParallelMode", "get_context"]
