"""The one table of pipeline schedules: ``parallel.pipeline.schedule`` -> the class that runs it.

Adding a schedule adds its file, one line here and its name to the config's
``ScheduleName``; a test checks that the two agree.
"""

from __future__ import annotations

from gridtrain.engine.schedules.gpipe import GPipeSchedule
from gridtrain.engine.schedules.interleaved import InterleavedPipelineSchedule
from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule
from gridtrain.parallel.context import ParallelContext

SCHEDULES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls for cls in (PipelineSchedule, InterleavedPipelineSchedule, GPipeSchedule)
}


def pipeline_schedule(ctx: ParallelContext) -> PipelineSchedule:
    """The schedule ``ctx.config`` names (``parallel.pipeline.schedule``, or its default)."""
    return SCHEDULES[ctx.config.parallel.pipeline.schedule_name].from_config(ctx)
