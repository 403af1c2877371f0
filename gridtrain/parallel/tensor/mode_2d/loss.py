"""Batch split, cross entropy and accuracy on the SUMMA grid (2D and 2.5D).

``split_batch`` gives rank (k, i, j) batch block ``k * q + i`` (Tesseract's
row order; k = 0 under 2D). Logits arrive either gathered (``Classifier``:
``[batch block, classes]`` on every rank of a grid row) or vocab-sharded
(``VocabParallelClassifier``: ``[batch block, vocab block j]``). The loss sums
per-token losses over the batch blocks (grid column and depth) and divides by
the whole batch's count, so every rank of the tensor group reports the mean
over its data-parallel rank's batch, and each rank back-propagates only its
own block's share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.tensor.mode_2d.grid import SummaGrid
from gridtrain.parallel.tensor.vocab import (
    GridCrossEntropyLoss,
    is_vocab_sharded,
    vocab_parallel_argmax,
)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's batch block of ``x`` ``[B, ...]``: block ``k * q + i`` of ``depth * q``."""
    g = SummaGrid.of(ctx)
    if x.dim() == 0:
        raise ValueError("split_batch: needs a batch tensor [B, ...], got a 0-d tensor")
    if x.shape[0] % g.batch_parts:
        raise ValueError(
            f"split_batch: batch size {x.shape[0]} must be divisible by {g.batch_parts} "
            f"(depth {g.depth} x q {g.q}) under tensor mode {ctx.tensor_mode!r}"
        )
    return x.chunk(g.batch_parts, dim=0)[g.batch_index]


def _batch_sum(x: Tensor, g: SummaGrid, differentiable: bool) -> Tensor:
    """Sum over the batch blocks: the grid column, then the depth slices."""
    groups = [g.col_group] + ([g.ctx.group(g.dep_mode)] if g.dep_mode else [])
    for group in groups:
        x = comm.reduce_from_group(x, group) if differentiable else comm.all_reduce_(x, group)
    return x


class CrossEntropyLoss(GridCrossEntropyLoss):
    """Cross entropy of blocked logits; the same value on every rank of the tensor group."""

    @property
    def grid(self) -> SummaGrid:
        return SummaGrid.of(self.ctx or get_context())

    def _vocab_group(self):
        g = self.grid  # vocab blocks along the grid row
        return g.row_group, g.j, g.q

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        return _batch_sum(x, self.grid, differentiable)


@torch.no_grad()
def accuracy(logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the group."""
    g = SummaGrid.of(ctx or get_context())
    if is_vocab_sharded(logits):
        pred = vocab_parallel_argmax(logits, g.row_group, g.j, g.q)
    else:
        pred = logits.argmax(dim=-1)
    correct = (pred == labels).sum()
    total = torch.tensor(labels.numel(), device=labels.device)
    return _batch_sum(correct, g, differentiable=False), _batch_sum(total, g, differentiable=False)
