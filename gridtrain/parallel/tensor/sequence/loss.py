"""Cross entropy and accuracy under sequence parallelism: token losses sum over SEQUENCE."""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.sequence.layout import (
    current_ctx,
    is_sequence_sharded,
    sequence_group,
)
from gridtrain.parallel.tensor.vocab import GridCrossEntropyLoss, plain


def _token_labels(labels: Tensor) -> bool:
    """Sequence-split labels: marked by the engine, or ``[B, S_local, ...]`` as split_batch gives."""
    return is_sequence_sharded(labels) or labels.dim() >= 2


class CrossEntropyLoss(GridCrossEntropyLoss):
    """Cross entropy whose mean covers the data rank's whole sequence, not just this shard.

    Token labels (split along the sequence) sum their losses and counts over the
    sequence group; labels ``[B]`` (e.g. sentence order, kept whole by ``split_batch``)
    are replicated and reduce locally, as the dense loss does.
    """

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        from gridtrain.parallel.tensor.chunked_loss import DeferredLogits, chunked_cross_entropy

        self._tokens = _token_labels(labels)
        if isinstance(logits, DeferredLogits):  # chunks of marked labels stay marked
            return chunked_cross_entropy(self, logits, labels)
        return super().forward(logits, labels.as_subclass(Tensor))

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        group = sequence_group(current_ctx(self.ctx))
        if group is None or not self._tokens:
            return x
        # backward all-reduces too: see layout.py's gradient convention
        return comm.all_reduce(x, group) if differentiable else comm.all_reduce_(x, group)


def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """(correct, total) over the data rank's batch: token labels summed over the sequence group."""
    tokens = _token_labels(labels)
    labels, logits = plain(labels.as_subclass(Tensor)), plain(logits)
    kept = labels != ignore_index
    correct = ((logits.argmax(dim=-1) == labels) & kept).sum()
    total = kept.sum()
    group = sequence_group(current_ctx(ctx))
    if group is not None and tokens:
        both = comm.all_reduce_(torch.stack([correct, total]).detach().clone(), group)
        correct, total = both[0], both[1]
    return correct, total
