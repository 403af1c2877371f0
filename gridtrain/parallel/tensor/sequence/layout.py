"""Sequence parallelism (Li et al. 2021): the sequence dimension is split across SEQUENCE.

``parallel = dict(tensor=dict(size=N, mode="sequence"))``. Every weight is
replicated; each rank of the sequence group holds ``S / N`` consecutive
positions of every ``[B, S, ...]`` activation, and self-attention is the only
layer that looks across positions (``attention.ring_attention``).

Gradient convention, which makes the default data-parallel averaging right:
after backward, the *sum* over the sequence group of a weight's gradient is
``N`` times the gradient of the loss the rank reports (the mean over its data
rank's whole batch). Token losses get there by a sum all-reduce whose backward
is a sum all-reduce (``comm.all_reduce``); replicated computation (a sentence
head on whole ``[B]`` labels) gets there by itself. Averaging over
SEQUENCE_DP (data x sequence ranks, ``tags.get_dp_mode``) then yields the
data-parallel mean of the dense gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.mode import ParallelMode

SEQUENCE = ParallelMode.SEQUENCE


class SequenceShardedLabels(Tensor):
    """Labels cut along the sequence like the activations: their loss sums over SEQUENCE.

    The engine marks the labels it splits; the mark survives ``reshape``/``flatten``.
    """


def mark_sequence_sharded(labels: Tensor) -> Tensor:
    return labels.as_subclass(SequenceShardedLabels)


def is_sequence_sharded(labels: Tensor) -> bool:
    return isinstance(labels, SequenceShardedLabels)


class ForwardMode(TorchFunctionMode):
    """A torch-function mode that a forward under ``ctx`` runs in (``sdpa.SequenceAttention``).
    Where no context is launched (``gridtrain estimate`` plans on a process-free ``Layout``),
    ``current_ctx`` falls back on it, so ``gt.nn.attention`` and the routed SDPA calls of one
    forward see the same split."""

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx


def current_ctx(ctx: ParallelContext | None) -> ParallelContext | None:
    """``ctx``, else the launched context, else that of the ``ForwardMode`` running now."""
    if ctx is not None:
        return ctx
    if has_context():
        return get_context()
    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, ForwardMode)]
    return modes[-1].ctx if modes else None


def splits_sequence(ctx: ParallelContext | None) -> bool:
    """Whether ``ctx`` splits positions over more than one rank (sizes only, so a
    process-free ``Layout``, as ``gridtrain estimate`` plans with, answers too)."""
    return ctx is not None and ctx.tensor_mode == "sequence" and ctx.world_size(SEQUENCE) > 1


def sequence_group(ctx: ParallelContext | None):
    """The SEQUENCE group when sequence parallelism is on (with more than one rank), else None."""
    return ctx.group(SEQUENCE) if splits_sequence(ctx) else None


def position_ids(seq_len: int, device=None, ctx: ParallelContext | None = None) -> Tensor:
    """Global positions of this rank's ``seq_len`` tokens: ``arange`` from its shard's offset."""
    ctx = current_ctx(ctx)
    offset = 0
    if splits_sequence(ctx):
        offset = ctx.local_rank(SEQUENCE) * seq_len
    return torch.arange(offset, offset + seq_len, device=device)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's shard of a batch tensor: ``[B, S, ...]`` is cut along dim 1 into N parts.

    Tensors of rank 0 or 1 (``[B]``: sentence labels, lengths) are kept whole on every rank.
    """
    if not splits_sequence(ctx) or x.dim() < 2:
        return x
    n = ctx.world_size(SEQUENCE)
    if x.shape[1] % n:
        raise ValueError(
            f"sequence parallelism: sequence length (dim 1 of a batch tensor of shape "
            f"{tuple(x.shape)}) must be divisible by parallel.tensor.size {n}"
        )
    return x.chunk(n, dim=1)[ctx.local_rank(SEQUENCE)].contiguous()
