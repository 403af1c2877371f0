"""Cross entropy and argmax of logits blocked over a grid: the core the 2D, 2.5D and 3D losses share.

Logits arrive either gathered (every class on each rank of a group) or
vocab-parallel (the classes cut into contiguous blocks over a *vocab group*).
Per-sample losses are summed over the ranks that hold different rows and
divided by the whole batch's count, so every rank of the tensor group reports
the dense run's value while each back-propagates only its own rows' share.
``GridCrossEntropyLoss`` holds that recipe; a mode says which group holds the
vocab blocks, how labels are re-cut to the vocab-parallel rows and how row
sums are taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context

VOCAB_PARALLEL_TAG = "_gt_vocab_parallel"  # set on the output of every VocabParallelClassifier


def is_vocab_parallel(logits: Tensor) -> bool:
    """Whether ``logits`` (or the tensor it is a view of) came from a VocabParallelClassifier."""
    base = logits._base if logits._base is not None else logits
    return bool(
        getattr(logits, VOCAB_PARALLEL_TAG, False) or getattr(base, VOCAB_PARALLEL_TAG, False)
    )


def vocab_parallel_nll(
    logits: Tensor, labels: Tensor, ignore_index: int, group, rank: int
) -> Tensor:
    """Per-sample ``logsumexp - target logit`` over the vocab blocks of ``group`` (Megatron's form).

    ``logits`` ``[N, n]`` hold vocab block ``rank`` (classes ``rank * n`` onwards);
    fp16/bf16 logits are computed in fp32.
    """
    n = logits.shape[-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted = logits - comm.all_reduce_max(logits.max(-1, keepdim=True).values, group)
    # the group computes one loss from these sums: reduce forward, pass the gradient unchanged
    sum_exp = comm.reduce_from_group(shifted.exp().sum(-1), group)
    local = labels - rank * n
    mine = (local >= 0) & (local < n) & (labels != ignore_index)
    picked = shifted.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    target = comm.reduce_from_group(picked.masked_fill(~mine, 0.0), group)
    return (sum_exp.log() - target).masked_fill(labels == ignore_index, 0.0)


def vocab_parallel_argmax(logits: Tensor, group, rank: int, world: int) -> Tensor:
    """Global argmax over the vocab blocks of ``group``; the first maximum wins, as in torch.argmax."""
    n = logits.shape[-1]
    best, index = logits.max(-1)
    top = comm.all_reduce_max(best, group)
    mine = torch.where(best == top, index + rank * n, torch.full_like(index, world * n))
    return -comm.all_reduce_max(-mine, group)  # the smallest index holding the max


class GridCrossEntropyLoss(nn.Module):
    """Cross entropy of blocked logits; every rank of the tensor group gets the dense run's value.

    Takes ``nn.CrossEntropyLoss``'s arguments; labels come from the mode's
    ``split_batch``. Vocab-parallel logits are recognised from
    ``VocabParallelClassifier``'s tag (kept by views); pass ``vocab_parallel=True``
    for a copy of them (e.g. ``.float()``). ``reduction="none"`` returns this
    rank's rows of per-sample losses. Subclasses give the mode's layout through
    ``_bind``, ``_rows``, ``_vocab_nll`` and ``_row_sum``.
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
        self._bind(ctx or get_context())

    def _bind(self, ctx: ParallelContext) -> None:
        """Keep this rank's place in the mode's layout (called once, from ``__init__``)."""
        raise NotImplementedError

    def _rows(self, labels: Tensor, vocab_parallel: bool) -> Tensor:
        """``split_batch``'s labels re-cut to the rows of the logits."""
        return labels

    def _vocab_nll(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-sample losses of vocab-parallel logits ``[N, vocab block]``."""
        raise NotImplementedError

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        """``x`` summed over the ranks that hold different rows of the logits."""
        raise NotImplementedError

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        vocab_parallel = self.vocab_parallel
        if vocab_parallel is None:
            vocab_parallel = is_vocab_parallel(logits)
        labels = self._rows(labels, vocab_parallel)
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
            per_sample = self._vocab_nll(logits, labels)
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
        # replicas of one row block each back-propagate the same loss: identity backward
        total = self._row_sum(per_sample.sum(), vocab_parallel, differentiable=True)
        if self.reduction == "sum":
            return total
        return total / self._row_sum(count.detach().clone(), vocab_parallel, differentiable=False)
