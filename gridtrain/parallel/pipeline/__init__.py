"""Pipeline parallelism: cutting a model into stages (``partition``) and stage-to-stage p2p.

``gt.initialize`` keeps this rank's stage when ``parallel.pipeline > 1``; the
1F1B and interleaved schedules live in ``gridtrain.engine.schedules``.
"""

from gridtrain.parallel.pipeline.partition import PipelineStage, build_stage, layer_list, partition

__all__ = ["PipelineStage", "build_stage", "layer_list", "partition"]
