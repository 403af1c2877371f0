"""MoeGradientHandler: expert gradients averaged over EXPERT_DATA, the rest over DATA."""

from __future__ import annotations

from gridtrain.gradient_handlers.data_parallel import DataParallelGradientHandler
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sync.buckets import Bucket


class MoeGradientHandler(DataParallelGradientHandler):
    """Average gradients after backward: expert parameters (tagged EXPERT_DATA by
    ``gridtrain.parallel.moe.Experts``) over EXPERT_DATA, every other one over DATA
    (SEQUENCE_DP under sequence parallelism).

    Each parameter's group is its data-parallel mode, as for ``DataParallelGradientHandler``;
    the engine's default overlapped path reduces each parameter over the same group, so
    naming this handler is only needed to reduce after backward instead of during it. kwargs: ``bucket_size_mb``. The 1/ep factor an expert's gradient
    needs lives in the experts' forward, so this handler is a plain mean per group.
    """

    @property
    def expert_buckets(self) -> list[Bucket]:
        """The buckets reduced over EXPERT_DATA."""
        return [b for b in self.buckets if b.mode == ParallelMode.EXPERT_DATA]
