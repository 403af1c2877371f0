"""Vocabulary-sharded logits: the marker every mode uses and the one cross-entropy core.

**The marker.** A vocab-parallel classifier returns its logits as a
``VocabShardedLogits`` tensor (a plain ``torch.Tensor`` subclass). torch keeps a
subclass through every operation, so the mark survives what loss code does to
logits (``reshape``, slicing, ``.float()`` under autocast) and
``gt.nn.CrossEntropyLoss()`` picks the vocab-parallel path by itself. The
classes are always on the *last* dim of marked logits.

**The core.** ``vocab_parallel_cross_entropy`` is Megatron-LM's vocab-parallel
cross entropy: only per-token maxima and sums cross the group, never the
``[tokens, vocab]`` logits; it takes ``ignore_index``, label smoothing and class
weights with ``F.cross_entropy``'s semantics, and keeps one softmax buffer that
backward turns into the gradient in place.

``GridCrossEntropyLoss`` is the loss module every tensor mode specialises: it
reads gathered or vocab-sharded logits, and sums per-token losses and counts
over the ranks that hold different rows, so every rank reports the dense run's
value while each back-propagates only its own rows' share.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm


class VocabShardedLogits(Tensor):
    """Logits whose last dim is this rank's contiguous block of the classes."""


def mark_vocab_sharded(logits: Tensor) -> Tensor:
    """View ``logits`` as ``VocabShardedLogits`` (same data, same autograd graph)."""
    return logits.as_subclass(VocabShardedLogits)


def is_vocab_sharded(t: Tensor) -> bool:
    return isinstance(t, VocabShardedLogits)


def plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (drops the marker)."""
    return t.as_subclass(Tensor) if isinstance(t, VocabShardedLogits) else t


def vocab_block_lookup(
    ids: Tensor, weight: Tensor, start: int, n: int, padding_idx: int | None
) -> Tensor:
    """Embeddings of ``ids`` from the vocabulary block ``[start, start + n)`` held in ``weight``.

    Ids outside the block give zero rows, so summing the blocks' outputs gives the
    dense lookup (their rows get no weight gradient either); ``padding_idx`` (in
    ``[0, num_embeddings)``) keeps its zero gradient where it is in the block.
    """
    local = ids - start
    mine = (local >= 0) & (local < n)
    pad = None
    if padding_idx is not None and 0 <= padding_idx - start < n:
        pad = padding_idx - start
    out = F.embedding(local.masked_fill(~mine, 0), weight, pad)
    return out.masked_fill(~mine.unsqueeze(-1), 0)


class _VocabParallelCE(torch.autograd.Function):
    """Per token: ``(1-eps) w_y (lse - z_y) + eps/V sum_c w_c (lse - z_c)`` from group sums."""

    @staticmethod
    def forward(fctx, logits, labels, group, start, vocab, ignore_index, smoothing, weight):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16: in fp32
        n = z.shape[-1]
        zmax = comm.all_reduce_max(z.max(dim=-1).values, group)
        z = z - zmax.unsqueeze(-1)  # a fresh tensor: reused in place below
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < n)
        local = local.masked_fill(~mine, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        w_local = None if weight is None else weight[start : start + n].to(z.dtype)
        zw = z.sum(-1) if w_local is None else z @ w_local
        sums = torch.stack([picked, zw, z.exp_().sum(-1)])  # z is now exp(z)
        comm.all_reduce_(sums, group)  # one collective for the three reductions
        picked, zw, expsum = sums
        lse = expsum.log()
        if weight is None:
            w_y, w_sum = torch.ones_like(lse), float(vocab)
        else:
            w_y = weight.to(z.dtype)[labels.masked_fill(~valid, 0)]
            w_sum = weight.to(z.dtype).sum()
        loss = (1 - smoothing) * w_y * (lse - picked) + smoothing / vocab * (w_sum * lse - zw)
        loss = loss.masked_fill(~valid, 0.0)
        z.div_(expsum.unsqueeze(-1))  # softmax, kept for backward
        fctx.save_for_backward(z, local, mine, valid, w_y, w_local)
        fctx.smoothing, fctx.vocab, fctx.w_sum = smoothing, vocab, w_sum
        fctx.dtype, fctx.used = logits.dtype, False
        return loss

    @staticmethod
    def backward(fctx, grad_loss):
        if fctx.used:  # the softmax buffer became the gradient in place
            raise RuntimeError("vocab-parallel cross entropy cannot run backward twice")
        fctx.used = True
        grad, local, mine, valid, w_y, w_local = fctx.saved_tensors
        eps, vocab = fctx.smoothing, fctx.vocab
        g = grad_loss * valid
        # d/dz_c = p_c ((1-eps) w_y + eps W / V) - (1-eps) w_y [c = y] - eps w_c / V
        grad.mul_(((1 - eps) * w_y + eps * fctx.w_sum / vocab).unsqueeze(-1))
        grad.scatter_add_(-1, local.unsqueeze(-1), (-(1 - eps) * w_y * mine).unsqueeze(-1))
        if eps:
            grad.sub_(eps / vocab if w_local is None else eps / vocab * w_local)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(fctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    group,
    rank: int,
    world: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    weight: Tensor | None = None,
) -> Tensor:
    """Per-token losses of logits ``[N, V / world]`` holding vocab block ``rank`` of ``group``.

    ``F.cross_entropy(..., reduction="none")``'s values; ``weight`` is the full ``[V]``
    class weight. Labels outside ``[0, V)`` (and not ``ignore_index``) are an error.
    """
    logits = plain(logits)
    n = logits.shape[-1]
    vocab = n * world
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():  # no rank would own such a label: the loss would silently be wrong
        raise ValueError(
            f"CrossEntropyLoss: labels must be in [0, {vocab}) or ignore_index={ignore_index}, "
            f"got {labels[bad][:5].tolist()}"
        )
    return _VocabParallelCE.apply(
        logits, labels, group, rank * n, vocab, ignore_index, label_smoothing, weight
    )


def vocab_parallel_argmax(logits: Tensor, group, rank: int, world: int) -> Tensor:
    """Global argmax over the vocab blocks of ``group``; the first maximum wins, as in torch.argmax."""
    logits = plain(logits)
    n = logits.shape[-1]
    best, index = logits.max(-1)
    top = comm.all_reduce_max(best, group)
    mine = torch.where(best == top, index + rank * n, torch.full_like(index, world * n))
    return -comm.all_reduce_max(-mine, group)  # the smallest index holding the max


def class_last(logits: Tensor, labels: Tensor) -> Tensor:
    """``logits`` with the class dim last: ``[..., C]`` as given, or ``nn.CrossEntropyLoss``'s
    ``[B, C, d1, ...]`` moved; an error names both shapes otherwise."""
    if tuple(logits.shape[:-1]) == tuple(labels.shape):
        return logits
    if logits.dim() == labels.dim() + 1 and logits.dim() > 2:
        if logits.shape[0] == labels.shape[0] and logits.shape[2:] == labels.shape[1:]:
            return logits.movedim(1, -1)
    raise ValueError(
        f"CrossEntropyLoss: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} "
        "plus a class dim (last, or at 1 as nn.CrossEntropyLoss takes it)"
    )


class GridCrossEntropyLoss(nn.Module):
    """Cross entropy of logits laid out by a tensor mode; every rank gets the dense run's value.

    Takes ``nn.CrossEntropyLoss``'s arguments. Vocab-sharded logits are recognised by
    their marker; ``vocab_parallel=True`` forces that path. ``reduction="none"``
    returns this rank's rows of per-token losses. A mode subclass says where the
    vocab blocks live (``_vocab_group``), how labels are re-cut to the rows of
    vocab-sharded logits (``_rows``) and how row sums are taken (``_row_sum``).
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        vocab_parallel: bool | None = None,
        ctx=None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(
                f"CrossEntropyLoss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
            )
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.vocab_parallel = label_smoothing, vocab_parallel
        self.ctx = ctx

    def _vocab_group(self) -> tuple:
        """(group, rank, world) of the ranks that hold the vocab blocks of one row."""
        raise NotImplementedError

    def _rows(self, labels: Tensor, vocab_parallel: bool) -> Tensor:
        return labels

    def _row_sum(self, x: Tensor, vocab_parallel: bool, differentiable: bool) -> Tensor:
        return x

    def with_reduction(self, reduction: str) -> GridCrossEntropyLoss:
        """A copy of this loss with another reduction (shares weight and context)."""
        other = copy.copy(self)
        object.__setattr__(other, "reduction", reduction)
        return other

    def count(self, labels: Tensor, vocab_parallel: bool) -> Tensor:
        """The mean's denominator: non-ignored labels (or their class weights), summed over
        the ranks holding different rows."""
        labels = self._rows(labels.as_subclass(Tensor), vocab_parallel).reshape(-1)
        valid = labels != self.ignore_index
        if self.weight is None:
            count = valid.sum().float()
        else:
            count = self.weight[labels.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        return self._row_sum(count.detach().clone(), vocab_parallel, differentiable=False)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        from gridtrain.parallel.tensor.chunked_loss import DeferredLogits, chunked_cross_entropy

        if isinstance(logits, DeferredLogits):
            return chunked_cross_entropy(self, logits, labels)
        sharded = self.vocab_parallel
        if sharded is None:
            sharded = is_vocab_sharded(logits)
        labels = self._rows(labels, sharded)
        logits = class_last(plain(logits), labels)
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = labels != self.ignore_index
        if sharded:
            group, rank, world = self._vocab_group()
            per_token = vocab_parallel_cross_entropy(
                logits, labels, group, rank, world, self.ignore_index, self.label_smoothing,
                self.weight,
            )  # fmt: skip
        else:
            per_token = F.cross_entropy(
                logits,
                labels,
                self.weight,
                ignore_index=self.ignore_index,
                reduction="none",
                label_smoothing=self.label_smoothing,
            )
        if self.reduction == "none":
            return per_token
        if self.weight is None:
            count = valid.sum().to(per_token.dtype)
        else:  # torch's weighted mean divides by the weights of the targets
            count = self.weight[labels.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        # replicas of one row block each back-propagate the same loss: identity backward
        total = self._row_sum(per_token.sum(), sharded, differentiable=True)
        if self.reduction == "sum":
            return total
        count = self._row_sum(count.detach().to(total.dtype).clone(), sharded, False)
        return total / count
