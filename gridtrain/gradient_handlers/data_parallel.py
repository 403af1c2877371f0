"""DataParallelGradientHandler: bucketed all-reduce of every gradient after backward."""

from __future__ import annotations

from torch import nn

from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sync.buckets import (
    DEFAULT_BUCKET_MB,
    Bucket,
    all_reduce_buckets,
    build_buckets,
)
from gridtrain.parallel.tags import get_dp_mode


class DataParallelGradientHandler(GradientHandler):
    """Average each gradient over its data-parallel group once backward has finished.

    The group is ``tags.get_dp_mode(param)``: DATA, SEQUENCE_DP under
    sequence parallelism, EXPERT_DATA for experts. It reduces after backward, in one
    pass; with no handler named the engine overlaps the same reduction with backward
    instead (faster), so name it only to keep the reduction out of the backward. kwargs: ``bucket_size_mb`` (default 25).
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float = DEFAULT_BUCKET_MB
    ):
        super().__init__(model, ctx)
        self.buckets: list[Bucket] = build_buckets(
            model.parameters(), ctx, lambda p: get_dp_mode(p, ctx), bucket_size_mb
        )

    def handle_gradient(self) -> None:
        all_reduce_buckets(self.buckets)
