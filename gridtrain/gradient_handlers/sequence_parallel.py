"""SequenceParallelGradientHandler: average gradients over all ranks of one pipeline stage."""

from __future__ import annotations

from torch import nn

from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.gradient_handlers.buckets import (
    DEFAULT_BUCKET_MB,
    Bucket,
    all_reduce_buckets,
    build_buckets,
)
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tags import get_dp_mode


class SequenceParallelGradientHandler(GradientHandler):
    """Average each gradient over SEQUENCE_DP (data x sequence ranks of one stage).

    Needs tensor mode "sequence". A parameter that names its own group with
    ``sharding.set_dp_mode`` (e.g. an expert) keeps that group. kwargs:
    ``bucket_size_mb`` (default 25).
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float = DEFAULT_BUCKET_MB
    ):
        super().__init__(model, ctx)
        if ctx.tensor_mode != "sequence":
            raise ValueError(
                "SequenceParallelGradientHandler needs parallel.tensor.mode 'sequence', "
                f"got {ctx.tensor_mode!r}; use DataParallelGradientHandler (or none) instead"
            )

        self.buckets: list[Bucket] = build_buckets(
            model.parameters(), ctx, lambda p: get_dp_mode(p, ctx), bucket_size_mb
        )

    def handle_gradient(self) -> None:
        all_reduce_buckets(self.buckets)
