"""Pipeline parallelism: partitioning, stage-to-stage p2p and the 1F1B / interleaved schedules.

``gt.initialize`` calls ``prepare_pipeline`` when ``parallel.pipeline > 1``; users
only write the config (``parallel.pipeline``, ``num_microbatches``) and, for models
too large for one device, build the model under ``lazy_init()``.
"""

from __future__ import annotations

import importlib
from typing import Any

from gridtrain.parallel.pipeline.partition import PipelineStage, lazy_init, partition

_LAZY = {  # these import the engine's Schedule base class: loaded on first use
    "PipelineSchedule": "gridtrain.parallel.pipeline.schedule",
    "InterleavedPipelineSchedule": "gridtrain.parallel.pipeline.schedule",
    "prepare_pipeline": "gridtrain.parallel.pipeline.engine_hooks",
    "mark_pipeline_shared": "gridtrain.parallel.pipeline.engine_hooks",
    "has_pipeline_shared": "gridtrain.parallel.pipeline.engine_hooks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PipelineStage", "lazy_init", "partition", *_LAZY]
