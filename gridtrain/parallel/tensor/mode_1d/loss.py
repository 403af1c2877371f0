"""1D batch split, cross entropy and accuracy: the batch is whole on every rank; only
vocab-sharded logits (a ``vocab_parallel`` head) need the group."""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.tensor.mode_1d.linear import PM1D
from gridtrain.parallel.tensor.vocab import (
    GridCrossEntropyLoss,
    is_vocab_sharded,
    vocab_parallel_argmax,
)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """1d keeps the whole batch on every rank of the tensor group."""
    return x


class CrossEntropyLoss(GridCrossEntropyLoss):
    """Cross entropy of replicated or vocab-sharded logits (rows are never split under 1d)."""

    def _vocab_group(self):
        ctx = self.ctx or get_context()
        return ctx.group(PM1D), ctx.local_rank(PM1D), ctx.world_size(PM1D)


@torch.no_grad()
def accuracy(logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's batch; on vocab-sharded logits the
    prediction is the global argmax (first index on ties, like ``argmax``)."""
    total = torch.tensor(labels.numel(), device=labels.device)
    if not is_vocab_sharded(logits):
        return (logits.argmax(dim=-1) == labels).sum(), total
    ctx = ctx or get_context()
    pred = vocab_parallel_argmax(
        logits, ctx.group(PM1D), ctx.local_rank(PM1D), ctx.world_size(PM1D)
    )
    return (pred == labels).sum(), total
