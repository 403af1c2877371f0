"""MoeGradientHandler: expert gradients averaged over EXPERT_DATA, the rest over DATA."""

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
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import get_dp_mode


class MoeGradientHandler(GradientHandler):
    """Average gradients after backward: expert parameters (tagged EXPERT_DATA by
    ``gridtrain.parallel.moe.Experts``) over EXPERT_DATA, every other one over DATA
    (SEQUENCE_DP under sequence parallelism).

    The engine's default overlapped path reduces each parameter over the same
    group, so naming this handler is only needed to reduce after backward
    instead of during it (the legacy behaviour). kwargs: ``bucket_size_mb``.
    The 1/ep factor an expert's gradient needs lives in the experts' forward,
    so this handler is a plain mean per group.
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float = DEFAULT_BUCKET_MB
    ):
        super().__init__(model, ctx)
        self.buckets: list[Bucket] = build_buckets(
            model.parameters(), ctx, lambda p: get_dp_mode(p, ctx), bucket_size_mb
        )

    @property
    def expert_buckets(self) -> list[Bucket]:
        """The buckets reduced over EXPERT_DATA."""
        return [b for b in self.buckets if b.mode == ParallelMode.EXPERT_DATA]

    def handle_gradient(self) -> None:
        all_reduce_buckets(self.buckets)
