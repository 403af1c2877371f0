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
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.mode_3d_ops import AXIS_B, AXIS_C, PAIR, Cube

VOCAB_PARALLEL_TAG = "_gt_vocab_parallel"  # same tag as the SUMMA modes' vocab-parallel logits


def labels_for_rows(labels: Tensor, row: PM, ctx: ParallelContext) -> Tensor:
    """``split_batch``'s rows (a, c) re-cut to rows (a, g) for the row axis ``row`` (B or C)."""
    if row == AXIS_C:
        return labels
    block = comm.all_gather_raw(labels, 0, ctx.group(AXIS_C))  # the whole batch block a
    return block.chunk(ctx.world_size(row), dim=0)[ctx.local_rank(row)]


def is_vocab_parallel(logits: Tensor) -> bool:
    """Whether ``logits`` (or the tensor it is a view of) came from a VocabParallelClassifier."""
    base = logits._base if logits._base is not None else logits
    return bool(
        getattr(logits, VOCAB_PARALLEL_TAG, False) or getattr(base, VOCAB_PARALLEL_TAG, False)
    )


# Gathered logits (Classifier): rows (a, c), every class, replicated over B -> rows summed over A x C.
# Vocab-parallel logits (VocabParallelClassifier): rows (a, b), vocab block c -> summed over A x B.
_ROWS_SUM = {False: PAIR[AXIS_C], True: PAIR[AXIS_B]}


def _vocab_nll(logits: Tensor, labels: Tensor, ignore_index: int, ctx: ParallelContext) -> Tensor:
    """Per-sample ``logsumexp - target logit`` over the vocab blocks of axis C (Megatron's form)."""
    group, n = ctx.group(AXIS_C), logits.shape[-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted = logits - comm.all_reduce_max(logits.max(-1, keepdim=True).values, group)
    # the C ranks compute one loss from these sums: reduce forward, pass the gradient unchanged
    sum_exp = comm.reduce_from_group(shifted.exp().sum(-1), group)
    local = labels - ctx.local_rank(AXIS_C) * n
    mine = (local >= 0) & (local < n) & (labels != ignore_index)
    picked = shifted.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    target = comm.reduce_from_group(picked.masked_fill(~mine, 0.0), group)
    return (sum_exp.log() - target).masked_fill(labels == ignore_index, 0.0)


class CrossEntropyLoss(nn.Module):
    """Cross entropy of 3D logits; every rank of the tensor group gets the dense run's value.

    Takes ``nn.CrossEntropyLoss``'s arguments; labels come from ``split_batch``.
    Vocab-parallel logits are recognised from ``VocabParallelClassifier``'s tag
    (kept by views); pass ``vocab_parallel=True`` for a copy of them. Each rank
    back-propagates only its own rows' share; ``reduction="none"`` returns this
    rank's rows of per-sample losses (rows (a, b) for vocab-parallel logits).
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
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.vocab_parallel = label_smoothing, vocab_parallel
        self.cube = Cube.of(ctx or get_context())

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        ctx = self.cube.ctx
        vocab_parallel = self.vocab_parallel
        if vocab_parallel is None:
            vocab_parallel = is_vocab_parallel(logits)
        if vocab_parallel:
            labels = labels_for_rows(labels, AXIS_B, ctx)
        if tuple(logits.shape[:-1]) != tuple(labels.shape):
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} must be labels "
                f"{tuple(labels.shape)} plus a last class dim"
            )
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = labels != self.ignore_index
        if vocab_parallel:
            if self.weight is not None or self.label_smoothing:
                raise NotImplementedError(
                    "CrossEntropyLoss: class weight and label_smoothing are not supported on "
                    "vocab-parallel logits"
                )
            per_sample = _vocab_nll(logits, labels, self.ignore_index, ctx)
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
        group = ctx.group(_ROWS_SUM[vocab_parallel])
        # replicas of one row block each back-propagate the same loss: identity backward
        total = comm.reduce_from_group(per_sample.sum(), group)
        if self.reduction == "sum":
            return total
        return total / comm.all_reduce_(count.detach().clone(), group)


def _vocab_argmax(logits: Tensor, ctx: ParallelContext) -> Tensor:
    """Global argmax over the vocab blocks of axis C; the first maximum wins, as in torch.argmax."""
    group, n, d = ctx.group(AXIS_C), logits.shape[-1], ctx.world_size(AXIS_C)
    best, index = logits.max(-1)
    top = comm.all_reduce_max(best, group)
    mine = torch.where(
        best == top, index + ctx.local_rank(AXIS_C) * n, torch.full_like(index, d * n)
    )
    return -comm.all_reduce_max(-mine, group)


@torch.no_grad()
def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the cube."""
    ctx = ctx or get_context()
    vocab_parallel = is_vocab_parallel(logits)
    if vocab_parallel:
        labels = labels_for_rows(labels, AXIS_B, ctx)
        pred = _vocab_argmax(logits, ctx)
    else:
        pred = logits.argmax(dim=-1)
    group = ctx.group(_ROWS_SUM[vocab_parallel])
    correct = comm.all_reduce_((pred == labels).sum(), group)
    total = comm.all_reduce_(torch.tensor(labels.numel(), device=labels.device), group)
    return correct, total
