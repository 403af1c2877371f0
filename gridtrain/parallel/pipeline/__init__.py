"""Pipeline parallelism: cutting a model into stages (``partition``; a model that runs its own
forward on every stage: ``model_stage``) and stage-to-stage p2p.

``gt.initialize`` keeps this rank's stage when ``parallel.pipeline > 1``; the
1F1B and interleaved schedules live in ``gridtrain.engine.schedules``.
"""

from gridtrain.parallel.pipeline.model_stage import ModelCut, StageUnit
from gridtrain.parallel.pipeline.partition import (
    METHODS,
    PipelineStage,
    build_stage,
    layer_list,
    mark_pipeline_shared,
    partition,
)
from gridtrain.parallel.pipeline.table import StageTable

__all__ = [
    "METHODS",
    "ModelCut",
    "PipelineStage",
    "StageTable",
    "StageUnit",
    "build_stage",
    "layer_list",
    "mark_pipeline_shared",
    "partition",
]
