"""The batch split, loss and accuracy of a run without a tensor mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.vocab import (
    GridCrossEntropyLoss,
    class_last,
    is_vocab_sharded,
    plain,
)


class CrossEntropyLoss(GridCrossEntropyLoss):
    """``nn.CrossEntropyLoss`` (class dim last, or at 1): rows and classes all on this rank."""

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        from gridtrain.parallel.tensor.chunked_loss import DeferredLogits

        if self.vocab_parallel or isinstance(logits, DeferredLogits) or is_vocab_sharded(logits):
            return super().forward(logits, labels)
        # whole rows and classes: torch's own loss, one fused kernel pair (the common case)
        logits = class_last(plain(logits), labels)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


def accuracy(logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's batch, as 0-d tensors."""
    correct = (plain(logits).argmax(dim=-1) == labels).sum()
    return correct, torch.tensor(labels.numel(), device=labels.device)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """No tensor parallelism: every rank of the tensor group keeps the whole batch."""
    return x
