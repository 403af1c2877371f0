"""SequenceParallelGradientHandler: average gradients over all ranks of one pipeline stage."""

from __future__ import annotations

from torch import nn

from gridtrain.gradient_handlers.data_parallel import DataParallelGradientHandler
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sync.buckets import DEFAULT_BUCKET_MB


class SequenceParallelGradientHandler(DataParallelGradientHandler):
    """Average each gradient over SEQUENCE_DP (data x sequence ranks of one stage).

    Needs tensor mode "sequence", where a parameter's data-parallel mode is SEQUENCE_DP.
    A parameter that names its own group with ``tags.set_dp_mode`` (e.g. an expert) keeps
    that group. kwargs: ``bucket_size_mb`` (default 25).
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float = DEFAULT_BUCKET_MB
    ):
        if ctx.tensor_mode != "sequence":
            raise ValueError(
                "SequenceParallelGradientHandler needs parallel.tensor.mode 'sequence', "
                f"got {ctx.tensor_mode!r}; use DataParallelGradientHandler (or none) instead"
            )
        super().__init__(model, ctx, bucket_size_mb)
