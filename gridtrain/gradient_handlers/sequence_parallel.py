"""SequenceParallelGradientHandler: average gradients over all ranks of one pipeline stage."""

from __future__ import annotations

from torch import nn

from gridtrain.gradient_handlers.data_parallel import DataParallelGradientHandler
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sync.buckets import DEFAULT_BUCKET_MB
from gridtrain.parallel.tensor.modes import names_where


class SequenceParallelGradientHandler(DataParallelGradientHandler):
    """Average each gradient over SEQUENCE_DP (data x sequence ranks of one stage).

    Needs a tensor mode whose data-parallel group is SEQUENCE_DP (sequence parallelism).
    A parameter that names its own group with ``tags.set_dp_mode`` (e.g. an expert) keeps
    that group. kwargs: ``bucket_size_mb`` (default 25).
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float = DEFAULT_BUCKET_MB
    ):
        if ctx.tensor_geometry.data_parallel is not ParallelMode.SEQUENCE_DP:
            modes = names_where(lambda g: g.data_parallel is ParallelMode.SEQUENCE_DP)
            raise ValueError(
                f"SequenceParallelGradientHandler needs parallel.tensor.mode {modes}, "
                f"got {ctx.tensor_mode!r}; use DataParallelGradientHandler (or none) instead"
            )
        super().__init__(model, ctx, bucket_size_mb)
