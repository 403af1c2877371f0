"""1D losses and metrics: vocab-parallel cross entropy without gathering the logits.

How ``CrossEntropyLoss`` knows the logits are sharded: ``VocabParallelClassifier``
returns them as a ``VocabShardedLogits`` tensor (a plain ``torch.Tensor``
subclass). torch propagates a subclass through every torch operation by default,
so the mark survives what loss code does to logits (``flatten``, slicing,
``reshape`` copies, ``.float()`` under AMP) and ``gt.nn.CrossEntropyLoss()``
picks the vocab-parallel path by itself; ``Classifier`` returns plain gathered
logits and gets ``F.cross_entropy``. ``CrossEntropyLoss(vocab_parallel=True)``
forces the sharded path for logits made elsewhere (e.g. a column-parallel Linear
used as a head). Sharded logits hold the classes on the *last* dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.mode_1d_linear import PM1D, tp
from gridtrain.parallel.tensor.vocab_loss import vocab_parallel_argmax


class VocabShardedLogits(Tensor):
    """Logits whose last dim is this rank's contiguous slice of the classes (1d group)."""


def mark_vocab_sharded(logits: Tensor) -> Tensor:
    """View ``logits`` as ``VocabShardedLogits`` (same data, same autograd graph)."""
    return logits.as_subclass(VocabShardedLogits)


def is_vocab_sharded(t: Tensor) -> bool:
    return isinstance(t, VocabShardedLogits)


def _plain(t: Tensor) -> Tensor:
    return t.as_subclass(Tensor) if isinstance(t, VocabShardedLogits) else t


class _VocabParallelCE(torch.autograd.Function):
    """Per-token ``logsumexp(z) - (1-eps) z_y - eps mean(z)`` from max and sums over the group."""

    @staticmethod
    def forward(ctx, logits, labels, group, start, vocab, ignore_index, smoothing):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16: in fp32
        local_v = z.shape[-1]
        zmax = comm.all_reduce_max(z.max(dim=-1).values, group)
        z = z - zmax.unsqueeze(-1)  # a fresh tensor: reused in place below
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < local_v)
        local = local.masked_fill(~mine, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([picked, z.sum(-1), z.exp_().sum(-1)])  # z is now exp(z)
        comm.all_reduce_(sums, group)  # one collective for the three reductions
        picked, zsum, expsum = sums
        loss = expsum.log() - (1 - smoothing) * picked - smoothing * zsum / vocab
        loss = loss.masked_fill(~valid, 0.0)
        z.div_(expsum.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(z, local, mine, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype, ctx.used = smoothing, vocab, logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:  # the softmax buffer became the gradient in place
            raise RuntimeError("vocab-parallel cross entropy cannot run backward twice")
        ctx.used = True
        grad, local, mine, valid = ctx.saved_tensors
        grad.scatter_add_(
            -1, local.unsqueeze(-1), -(1 - ctx.smoothing) * mine.unsqueeze(-1).to(grad.dtype)
        )
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    ctx: ParallelContext | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` of logits sharded over the 1d group along the last (class) dim.

    Only per-token maxima and sums cross the group (Megatron-LM's vocab-parallel
    CE), never the ``[..., vocab]`` logits. ``labels`` has ``logits.shape[:-1]``;
    ``reduction`` is "mean" (over non-ignored labels), "sum" or "none".
    """
    ctx, n, rank = tp(ctx)
    logits = _plain(logits)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} must have the logits' shape without the "
            f"class dim, {tuple(logits.shape[:-1])}"
        )
    local_v = logits.shape[-1]
    vocab = local_v * n
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():  # no rank would own such a label: the loss would silently be wrong
        raise ValueError(
            f"labels must be in [0, {vocab}) or ignore_index={ignore_index}, "
            f"got {labels[bad][:5].tolist()}"
        )
    loss = _VocabParallelCE.apply(
        logits, labels, ctx.group(PM1D), rank * local_v, vocab, ignore_index, label_smoothing
    )
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (labels != ignore_index).sum()
    return loss


class CrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss``'s arguments; vocab-parallel on ``VocabShardedLogits``
    (module docstring), plain ``F.cross_entropy`` on gathered logits.

    ``vocab_parallel``: None = decide from the logits; True/False force the path.
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
        self.weight, self.ignore_index = weight, ignore_index
        self.reduction, self.label_smoothing = reduction, label_smoothing
        self.vocab_parallel = vocab_parallel
        self._ctx = ctx

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        sharded = is_vocab_sharded(logits) if self.vocab_parallel is None else self.vocab_parallel
        if not sharded:
            return F.cross_entropy(
                _plain(logits),
                labels,
                weight=self.weight,
                ignore_index=self.ignore_index,
                reduction=self.reduction,
                label_smoothing=self.label_smoothing,
            )
        if self.weight is not None:
            raise NotImplementedError("class weights are not supported on vocab-sharded logits")
        return vocab_parallel_cross_entropy(
            logits, labels, self._ctx, self.ignore_index, self.reduction, self.label_smoothing
        )


@torch.no_grad()
def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's batch; on vocab-sharded logits the
    prediction is the global argmax (first index on ties, like ``argmax``)."""
    total = torch.tensor(labels.numel(), device=labels.device)
    if not is_vocab_sharded(logits):
        return (logits.argmax(dim=-1) == labels).sum(), total
    ctx, n, rank = tp(ctx)
    pred = vocab_parallel_argmax(_plain(logits), ctx.group(PM1D), rank, n)
    return (pred == labels).sum(), total
