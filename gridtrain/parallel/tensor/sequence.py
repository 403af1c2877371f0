"""Sequence parallelism (Li et al. 2021): the sequence dimension is split across SEQUENCE.

``parallel = dict(tensor=dict(size=N, mode="sequence"))``. Every weight is
replicated; each rank of the sequence group holds ``S / N`` consecutive
positions of every ``[B, S, ...]`` activation, and self-attention is the only
layer that looks across positions (``ring_attention``, keys and values travel
the ring). Layers here have the dense constructor arguments and dense state
dicts (nothing is sharded, so full state dicts are the local ones).

Gradient convention, which makes the default data-parallel averaging right:
after backward, the *sum* over the sequence group of a weight's gradient is
``N`` times the gradient of the loss the rank reports (the mean over its data
rank's whole batch). Token losses get there by a sum all-reduce whose backward
is a sum all-reduce (``comm.all_reduce``); replicated computation (a sentence
head on whole ``[B]`` labels) gets there by itself. Averaging over
SEQUENCE_DP (data x sequence ranks, ``sharding.get_dp_mode``) then yields the
data-parallel mean of the dense gradient: ``SequenceParallelGradientHandler``
and the engine's default path both do exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor.ring_attention import (
    allowed_mask,
    default_scale,
    online_attention,
    standard_attention,
)

SEQUENCE = ParallelMode.SEQUENCE
VARIANTS = ("standard", "online")

# replicated weights, per-token compute: the dense layers act on each rank's positions as they are
Linear = nn.Linear
LayerNorm = nn.LayerNorm
Classifier = dense.Classifier
VocabParallelClassifier = dense.Classifier  # the vocabulary is not split under 'sequence'


def _ctx(ctx: ParallelContext | None) -> ParallelContext | None:
    if ctx is not None:
        return ctx
    return get_context() if has_context() else None


def _sequence_group(ctx: ParallelContext | None):
    """The SEQUENCE group when sequence parallelism is on (with more than one rank), else None."""
    if ctx is None or ctx.tensor_mode != "sequence" or ctx.world_size(SEQUENCE) == 1:
        return None
    return ctx.group(SEQUENCE)


def position_ids(seq_len: int, device=None, ctx: ParallelContext | None = None) -> Tensor:
    """Global positions of this rank's ``seq_len`` tokens: ``arange`` from its shard's offset."""
    ctx = _ctx(ctx)
    offset = 0
    if _sequence_group(ctx) is not None:
        offset = ctx.local_rank(SEQUENCE) * seq_len
    return torch.arange(offset, offset + seq_len, device=device)


class Embedding(nn.Embedding):
    """``nn.Embedding``; for position tables feed it ``position_ids(local_len)`` (global offsets)."""


VocabParallelEmbedding = Embedding  # the vocabulary is not split under 'sequence'


class Dropout(nn.Dropout):
    """Dropout on sequence-sharded activations: each sequence rank draws its own mask."""

    def forward(self, x: Tensor) -> Tensor:
        ctx = _ctx(None)
        if not self.training or self.p == 0 or _sequence_group(ctx) is None:
            return super().forward(x)
        with ctx.fork_rng(SEQUENCE):
            return super().forward(x)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross entropy whose mean covers the data rank's whole sequence, not just this shard.

    Arguments follow ``nn.CrossEntropyLoss`` (class dim 1). Token labels keep their
    ``[B, S_local]`` shape (logits ``[B, C, S_local]``; do not flatten them): their
    loss sums over the sequence group and divides by the group's count of
    non-ignored tokens. Labels ``[B]`` (e.g. sentence order, kept whole by
    ``split_batch``) are replicated and reduce locally, as the dense layer does.
    ``reduction`` is 'mean' or 'sum'.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.reduction not in ("mean", "sum"):
            raise ValueError(
                f"sequence CrossEntropyLoss: reduction must be 'mean' or 'sum', got {self.reduction!r}"
            )

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        group = _sequence_group(_ctx(None))
        if group is None or labels.dim() < 2:
            return super().forward(logits, labels)
        if logits.dim() != labels.dim() + 1:
            raise ValueError(
                f"sequence CrossEntropyLoss: logits {tuple(logits.shape)} must be labels "
                f"{tuple(labels.shape)} with a class dim at 1"
            )
        total = F.cross_entropy(
            logits.float(),
            labels,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )
        total = comm.all_reduce(total, group)  # backward all-reduces too: see module docstring
        if self.reduction == "sum":
            return total
        kept = labels != self.ignore_index
        if self.weight is not None:
            count = (self.weight[labels.clamp_min(0)] * kept).sum().float()
        else:
            count = kept.sum().float()
        count = comm.all_reduce_(count.detach().clone(), group)
        return total / count


def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """(correct, total) over the data rank's batch: token labels summed over the sequence group."""
    kept = labels != ignore_index
    correct = ((logits.argmax(dim=-1) == labels) & kept).sum()
    total = kept.sum()
    group = _sequence_group(_ctx(ctx))
    if group is not None and labels.dim() >= 2:
        both = comm.all_reduce_(torch.stack([correct, total]).detach().clone(), group)
        correct, total = both[0], both[1]
    return correct, total


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's shard of a batch tensor: ``[B, S, ...]`` is cut along dim 1 into N parts.

    Tensors of rank 0 or 1 (``[B]``: sentence labels, lengths) are kept whole on every rank.
    """
    group = _sequence_group(ctx)
    if group is None or x.dim() < 2:
        return x
    n = ctx.world_size(SEQUENCE)
    if x.shape[1] % n:
        raise ValueError(
            f"sequence parallelism: sequence length (dim 1 of a batch tensor of shape "
            f"{tuple(x.shape)}) must be divisible by parallel.tensor.size {n}"
        )
    return x.chunk(n, dim=1)[ctx.local_rank(SEQUENCE)].contiguous()


def _dense_attention(q, k, v, causal, key_padding_mask, dropout_p, scale):
    s = q.shape[-2]
    mask = allowed_mask(range(s), range(k.shape[-2]), causal, key_padding_mask)
    if mask is not None:
        mask = mask.to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    variant: str | None = None,
    ctx: ParallelContext | None = None,
) -> Tensor:
    """Softmax attention over the whole sequence from this rank's ``[B, H, s, D]`` shards.

    Without sequence parallelism this is ``scaled_dot_product_attention``, so model
    code calls it unconditionally. ``key_padding_mask``: ``[B, s]`` bool of this
    rank's keys, True = padding (as ``nn.MultiheadAttention``). ``variant``:
    'standard' (RingQK/RingAV, ``s x S`` scores) or 'online' (online softmax,
    one ``s x s`` block at a time); None reads ``parallel.tensor.ring_attention``.
    Rows whose keys are all masked give zeros under 'online' and NaN elsewhere.
    """
    if q.dim() != 4 or k.shape != q.shape[:-1] + (k.shape[-1],) or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"ring_attention: q, k, v must be [B, H, s, D] with equal B, H, s; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if key_padding_mask is not None:
        if key_padding_mask.shape != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"ring_attention: key_padding_mask must be [B, s] = {(q.shape[0], q.shape[2])}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        key_padding_mask = key_padding_mask.bool()
    ctx = _ctx(ctx)
    if variant is None:
        variant = ctx.config.parallel.tensor.ring_attention if ctx is not None else "standard"
    if variant not in VARIANTS:
        raise ValueError(f"ring_attention: variant must be one of {VARIANTS}, got {variant!r}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    group = _sequence_group(ctx)
    if group is None:
        return _dense_attention(q, k, v, causal, key_padding_mask, dropout_p, scale)
    if key_padding_mask is not None:  # [B, S] bools are tiny next to the keys: gather them
        key_padding_mask = comm.all_gather_raw(key_padding_mask.to(torch.uint8), 1, group).bool()
    if variant == "standard":
        with ctx.fork_rng(SEQUENCE):
            return standard_attention(q, k, v, group, causal, key_padding_mask, dropout_p, scale)
    seed = 0
    if dropout_p > 0:
        with ctx.fork_rng(SEQUENCE):
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item())
    return online_attention(q, k, v, group, causal, key_padding_mask, dropout_p, scale, seed)


def PatchEmbedding(*args, **kwargs):  # noqa: N802 - the canonical layer name
    """Not provided under 'sequence': images are not sequences until after the stem."""
    raise NotImplementedError(
        "gt.nn.PatchEmbedding is not available under tensor mode 'sequence'; "
        "split image patches with split_batch after a dense stem instead"
    )
