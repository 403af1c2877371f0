"""Cross entropy and accuracy of 3D logits: every rank of the cube reports the dense value.

Logits arrive either gathered (``Classifier``: rows (a, c) of ``split_batch`` with
every class, replicated over B) or vocab-parallel (``VocabParallelClassifier``:
rows (a, b), vocab block c; the labels are re-cut to those rows here). Per-sample
losses are summed over the ranks that hold different rows (the pair group) and
divided by the whole batch's count; replicas of one row block back-propagate
the same loss, so each rank's gradient is its own rows' share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.mode_3d_ops import AXIS_B, AXIS_C, PAIR, Cube
from gridtrain.parallel.tensor.vocab_loss import (
    GridCrossEntropyLoss,
    is_vocab_parallel,
    vocab_parallel_argmax,
    vocab_parallel_nll,
)


def labels_for_rows(labels: Tensor, row: PM, ctx: ParallelContext) -> Tensor:
    """``split_batch``'s rows (a, c) re-cut to rows (a, g) for the row axis ``row`` (B or C)."""
    if row == AXIS_C:
        return labels
    block = comm.all_gather_raw(labels, 0, ctx.group(AXIS_C))  # the whole batch block a
    return block.chunk(ctx.world_size(row), dim=0)[ctx.local_rank(row)]


# Gathered logits (Classifier): rows (a, c), every class, replicated over B -> rows summed over A x C.
# Vocab-parallel logits (VocabParallelClassifier): rows (a, b), vocab block c -> summed over A x B.
_ROWS_SUM = {False: PAIR[AXIS_C], True: PAIR[AXIS_B]}


class CrossEntropyLoss(GridCrossEntropyLoss):
    """Cross entropy of 3D logits; every rank of the tensor group gets the dense run's value.

    Takes ``nn.CrossEntropyLoss``'s arguments; labels come from ``split_batch``.
    Vocab-parallel logits are recognised from ``VocabParallelClassifier``'s tag
    (kept by views); pass ``vocab_parallel=True`` for a copy of them. Each rank
    back-propagates only its own rows' share; ``reduction="none"`` returns this
    rank's rows of per-sample losses (rows (a, b) for vocab-parallel logits).
    """

    def _bind(self, ctx: ParallelContext) -> None:
        self.cube = Cube.of(ctx)

    def _rows(self, labels: Tensor, vocab_parallel: bool) -> Tensor:
        return labels_for_rows(labels, AXIS_B, self.cube.ctx) if vocab_parallel else labels

    def _vocab_nll(self, logits: Tensor, labels: Tensor) -> Tensor:
        ctx = self.cube.ctx  # vocab blocks over axis C
        return vocab_parallel_nll(
            logits, labels, self.ignore_index, ctx.group(AXIS_C), ctx.local_rank(AXIS_C)
        )

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        group = self.cube.ctx.group(_ROWS_SUM[vocab_parallel])
        return comm.reduce_from_group(x, group) if differentiable else comm.all_reduce_(x, group)


@torch.no_grad()
def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the cube."""
    ctx = ctx or get_context()
    vocab_parallel = is_vocab_parallel(logits)
    if vocab_parallel:
        labels = labels_for_rows(labels, AXIS_B, ctx)
        pred = vocab_parallel_argmax(
            logits, ctx.group(AXIS_C), ctx.local_rank(AXIS_C), ctx.world_size(AXIS_C)
        )
    else:
        pred = logits.argmax(dim=-1)
    group = ctx.group(_ROWS_SUM[vocab_parallel])
    correct = comm.all_reduce_((pred == labels).sum(), group)
    total = comm.all_reduce_(torch.tensor(labels.numel(), device=labels.device), group)
    return correct, total
