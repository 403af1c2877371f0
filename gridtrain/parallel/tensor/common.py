"""Pieces the layers of the tensor modes share: constructor checks and LayerNorm over a
split hidden dim (2D, 2.5D, 3D), the vocabulary-block lookup (1D, 2D, 2.5D, 3D)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gridtrain.parallel import comm


def check_divisible(layer: str, arg: str, value: int, by: int, why: str) -> None:
    """Raise a ValueError naming the argument unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{layer}: {arg}={value} must be divisible by {by} ({why})")


def layer_norm_width(normalized_shape) -> int:
    """The one hidden dim of ``nn.LayerNorm``'s ``normalized_shape`` (an int or a 1-tuple)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"LayerNorm: normalized_shape must be one dim, got {normalized_shape}")
    return shape[0]


def normalize_over_group(x: Tensor, hidden: int, eps: float, group) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over a hidden dim of width ``hidden`` split over ``group``.

    ``x`` is this rank's hidden block; the statistics are all-reduced over the
    group, and each rank normalises its own block with them (so the gradients
    of the sums are summed back over the group). No dtype cast: callers choose it.
    """
    mean = comm.all_reduce(x.sum(-1, keepdim=True), group) / hidden
    xc = x - mean
    var = comm.all_reduce((xc * xc).sum(-1, keepdim=True), group) / hidden
    return xc * torch.rsqrt(var + eps)


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
