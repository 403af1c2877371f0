"""Cross entropy and accuracy of 3D logits: every rank of the cube reports the dense value.

Logits arrive either gathered (``Classifier``: rows (i, OUTPUT block) of
``split_batch`` with every class, replicated over WEIGHT) or vocab-sharded
(``VocabParallelClassifier``: rows (i, WEIGHT block), vocab block over OUTPUT; the
labels are re-cut to those rows here). Per-token losses are summed over the
ranks that hold different rows (a pair group) and divided by the whole batch's
count; replicas of one row block back-propagate the same loss, so each rank's
gradient is its own rows' share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.mode_3d.cube import OUTPUT, PAIR, WEIGHT
from gridtrain.parallel.tensor.vocab import (
    GridCrossEntropyLoss,
    is_vocab_sharded,
    vocab_parallel_argmax,
)

# gathered logits: rows (i, OUTPUT block) -> summed over INPUT x OUTPUT;
# vocab-sharded logits: rows (i, WEIGHT block) -> summed over INPUT x WEIGHT
_ROWS_SUM = {False: PAIR[OUTPUT], True: PAIR[WEIGHT]}


def labels_for_rows(labels: Tensor, row_axis: PM, ctx: ParallelContext) -> Tensor:
    """``split_batch``'s rows (i, OUTPUT block) re-cut to rows (i, ``row_axis`` block)."""
    if row_axis == OUTPUT:
        return labels
    block = comm.all_gather_raw(labels, 0, ctx.group(OUTPUT))  # the whole batch block i
    return block.chunk(ctx.world_size(row_axis), dim=0)[ctx.local_rank(row_axis)]


class CrossEntropyLoss(GridCrossEntropyLoss):
    """Cross entropy of 3D logits; every rank of the tensor group gets the dense run's value."""

    def _ctx(self) -> ParallelContext:
        return self.ctx or get_context()

    def _vocab_group(self):
        ctx = self._ctx()  # vocab blocks over OUTPUT
        return ctx.group(OUTPUT), ctx.local_rank(OUTPUT), ctx.world_size(OUTPUT)

    def _rows(self, labels: Tensor, vocab_parallel: bool) -> Tensor:
        return labels_for_rows(labels, WEIGHT, self._ctx()) if vocab_parallel else labels

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        group = self._ctx().group(_ROWS_SUM[vocab_parallel])
        return comm.reduce_from_group(x, group) if differentiable else comm.all_reduce_(x, group)


@torch.no_grad()
def accuracy(logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the cube."""
    ctx = ctx or get_context()
    sharded = is_vocab_sharded(logits)
    if sharded:
        labels = labels_for_rows(labels, WEIGHT, ctx)
        pred = vocab_parallel_argmax(
            logits, ctx.group(OUTPUT), ctx.local_rank(OUTPUT), ctx.world_size(OUTPUT)
        )
    else:
        pred = logits.argmax(dim=-1)
    group = ctx.group(_ROWS_SUM[sharded])
    correct = comm.all_reduce_((pred == labels).sum(), group)
    total = comm.all_reduce_(torch.tensor(labels.numel(), device=labels.device), group)
    return correct, total
