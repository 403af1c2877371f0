"""Batch split, cross entropy and accuracy on the SUMMA grid (2D and 2.5D).

``split_batch`` gives rank (k, i, j) batch block ``k * q + i`` (Tesseract's
row order; k = 0 under 2D). Logits arrive either gathered (``Classifier``:
``[batch block, classes]`` on every rank of a grid row) or vocab-parallel
(``VocabParallelClassifier``: ``[batch block, vocab block j]``). The loss sums
per-sample losses over the batch blocks (grid column and depth) and divides by
the whole batch's count, so every rank of the tensor group reports the mean
over its data-parallel rank's batch, and each rank back-propagates only its
own block's share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.tensor.summa import SummaGrid

VOCAB_PARALLEL_TAG = "_gt_vocab_parallel"


def is_vocab_parallel(logits: Tensor) -> bool:
    """Whether ``logits`` (or the tensor it is a view of) came from a VocabParallelClassifier."""
    base = logits._base if logits._base is not None else logits
    return bool(
        getattr(logits, VOCAB_PARALLEL_TAG, False) or getattr(base, VOCAB_PARALLEL_TAG, False)
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


def _vocab_parallel_nll(logits: Tensor, labels: Tensor, ignore_index: int, g: SummaGrid) -> Tensor:
    """Per-sample ``logsumexp - target logit`` over vocab blocks along the grid row (Megatron)."""
    n = logits.shape[-1]
    logits = logits.float()
    shifted = logits - comm.all_reduce_max(logits.max(-1, keepdim=True).values, g.row_group)
    # the row computes one loss from these sums: reduce forward, pass the gradient unchanged
    sum_exp = comm.reduce_from_group(shifted.exp().sum(-1), g.row_group)
    local = labels - g.j * n
    mine = (local >= 0) & (local < n) & (labels != ignore_index)
    picked = shifted.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    target = comm.reduce_from_group(picked.masked_fill(~mine, 0.0), g.row_group)
    return (sum_exp.log() - target).masked_fill(labels == ignore_index, 0.0)


class CrossEntropyLoss(nn.Module):
    """Cross entropy of blocked logits; the same value on every rank of the tensor group.

    Takes ``nn.CrossEntropyLoss``'s arguments. Logits are ``[..., classes]`` with
    labels ``[...]`` (this rank's batch block, from ``split_batch``). Vocab-parallel
    logits are recognised from ``VocabParallelClassifier``'s tag (kept by views);
    pass ``vocab_parallel=True`` for logits made from them by a copy (e.g. ``.float()``).
    ``reduction="none"`` returns this rank's block of per-sample losses.
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        vocab_parallel: bool | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(
                f"CrossEntropyLoss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
            )
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = (
            ignore_index,
            reduction,
            label_smoothing,
        )
        self.vocab_parallel = vocab_parallel
        self.grid = SummaGrid.of(ctx or get_context())

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        g = self.grid
        if tuple(logits.shape[:-1]) != tuple(labels.shape):
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} "
                "plus a last class dim"
            )
        vocab_parallel = self.vocab_parallel
        if vocab_parallel is None:
            vocab_parallel = is_vocab_parallel(logits)
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = labels != self.ignore_index
        if vocab_parallel:
            if self.weight is not None or self.label_smoothing:
                raise NotImplementedError(
                    "CrossEntropyLoss: class weight and label_smoothing are not supported on "
                    "vocab-parallel logits"
                )
            per_sample = _vocab_parallel_nll(logits, labels, self.ignore_index, g)
            count = valid.sum().to(per_sample.dtype)
        else:
            per_sample = F.cross_entropy(
                logits,
                labels,
                self.weight,
                ignore_index=self.ignore_index,
                reduction="none",
                label_smoothing=self.label_smoothing,
            )
            if self.weight is None:
                count = valid.sum().to(per_sample.dtype)
            else:  # torch's weighted mean divides by the weights of the targets
                count = self.weight[labels.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        if self.reduction == "none":
            return per_sample
        total = _batch_sum(per_sample.sum(), g, differentiable=True)
        if self.reduction == "sum":
            return total
        return total / _batch_sum(count.detach().clone(), g, differentiable=False)


def _vocab_parallel_argmax(logits: Tensor, g: SummaGrid) -> Tensor:
    """Global argmax over the row's vocab blocks; the first maximum wins, as in torch.argmax."""
    n = logits.shape[-1]
    best, index = logits.max(-1)
    top = comm.all_reduce_max(best, g.row_group)
    mine = torch.where(best == top, index + g.j * n, torch.full_like(index, g.q * n))
    return -comm.all_reduce_max(-mine, g.row_group)


@torch.no_grad()
def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the group."""
    g = SummaGrid.of(ctx or get_context())
    if is_vocab_parallel(logits):
        pred = _vocab_parallel_argmax(logits, g)
    else:
        pred = logits.argmax(dim=-1)
    correct = (pred == labels).sum()
    total = torch.tensor(labels.numel(), device=labels.device)
    return _batch_sum(correct, g, differentiable=False), _batch_sum(total, g, differentiable=False)
