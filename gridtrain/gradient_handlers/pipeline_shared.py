"""PipelineSharedModuleGradientHandler: sum the gradients of weights tied between the first and the
last pipeline stage (GPT's token embedding and its output head)."""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.pipeline.p2p import first_last_stage_group
from gridtrain.parallel.tags import is_pipeline_shared, pipeline_tie


class PipelineSharedModuleGradientHandler(GradientHandler):
    """All-reduce (sum) the gradients of parameters tagged pipeline-shared (``tags.mark_pipeline_shared``).

    In the dense model a tied weight's gradient is the sum of the gradients of
    its uses; after pipeline partitioning each use lives on its own stage with
    its own copy, so summing over the {first, last} stage pair gives both
    copies the dense gradient and they stay equal after every step.

    The partitioner tags such weights when one Parameter object is used by
    layers of the first and of the last stage (``Classifier(weight=emb.weight)``);
    ``gridtrain.parallel.pipeline.mark_pipeline_shared(param)`` tags weights that
    are tied but built separately. Construction is collective over all ranks
    (it creates the stage-pair groups).
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, **kwargs):
        super().__init__(model, ctx)
        shared = [p for p in model.parameters() if is_pipeline_shared(p)]
        # both stages must list the copies in the same order: by tie index where known
        self.params = sorted(shared, key=pipeline_tie)
        pipeline = ctx.world_size(ParallelMode.PIPELINE)
        self.group = first_last_stage_group(ctx) if pipeline > 1 else None
        stage = ctx.local_rank(ParallelMode.PIPELINE)
        if self.params and stage not in (0, pipeline - 1):
            raise ValueError(
                f"pipeline stage {stage} holds {len(self.params)} weights tagged "
                "pipeline-shared; only the first and the last stage may share weights"
            )

    @torch.no_grad()
    def handle_gradient(self) -> None:
        if self.group is None or not self.params:
            return
        # a tied weight unused in this step still joins the sum, with a zero gradient
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = comm.all_reduce_(_flatten_dense_tensors(grads), self.group)
        for p, g in zip(self.params, _unflatten_dense_tensors(flat, grads), strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
