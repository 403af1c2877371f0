"""Schedules: how one batch becomes forward and backward passes, chosen by name.

``non_pipeline`` (one pass), ``1f1b`` (pipeline, PipeDream-Flush) and
``interleaved`` (pipeline with model chunks). Each receives ``StepFunctions``
from the engine and never the engine itself.
"""

from gridtrain.engine.schedules.base import Schedule, StepFunctions, load_batch, to_device
from gridtrain.engine.schedules.interleaved import InterleavedPipelineSchedule, check_interleaved
from gridtrain.engine.schedules.non_pipeline import NonPipelineSchedule
from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule

__all__ = [
    "InterleavedPipelineSchedule",
    "NonPipelineSchedule",
    "PipelineSchedule",
    "Schedule",
    "StepFunctions",
    "check_interleaved",
    "load_batch",
    "to_device",
]
