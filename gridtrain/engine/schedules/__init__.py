"""Schedules: how one batch becomes forward and backward passes, chosen by name.

``non_pipeline`` (one pass) without pipeline parallelism; with it, the schedule that
``parallel.pipeline.schedule`` names in ``SCHEDULES``: ``1f1b`` (PipeDream-Flush),
``interleaved`` (model chunks) or ``gpipe`` (all forwards, then all backwards). Each
receives ``StepFunctions`` from the engine and never the engine itself, and keeps nothing
from one call to the next.
"""

from gridtrain.engine.schedules.base import Schedule, StepFunctions, load_batch, to_device
from gridtrain.engine.schedules.gpipe import GPipeSchedule
from gridtrain.engine.schedules.interleaved import InterleavedPipelineSchedule
from gridtrain.engine.schedules.non_pipeline import NonPipelineSchedule
from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule
from gridtrain.engine.schedules.table import SCHEDULES, pipeline_schedule

__all__ = [
    "SCHEDULES",
    "GPipeSchedule",
    "InterleavedPipelineSchedule",
    "NonPipelineSchedule",
    "PipelineSchedule",
    "Schedule",
    "StepFunctions",
    "load_batch",
    "pipeline_schedule",
    "to_device",
]
