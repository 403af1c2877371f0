"""Normalisation over a hidden dim that is split over a group: what LayerNorm and RMSNorm
become under 2D, 2.5D and 3D, and how the planner recognises a norm it may replace."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gridtrain.parallel import comm


@dataclass(frozen=True)
class NormKind:
    """What a dense norm module computes: ``rms`` (no centring) or LayerNorm, over ``hidden``."""

    hidden: int
    eps: float
    rms: bool
    has_weight: bool
    has_bias: bool


def norm_kind(module: nn.Module) -> NormKind | None:
    """The norm ``module`` computes over its last dim, or None if it is not one we know.

    ``nn.LayerNorm`` and ``nn.RMSNorm`` (one normalised dim), and RMSNorm-style modules
    of other libraries (a class named ``*RMSNorm`` with a ``weight`` of shape ``[hidden]``
    and ``eps`` or ``variance_epsilon``, computing ``weight * x / rms(x)``, as Llama's).
    """
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            return None
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        return NormKind(
            shape[0],
            eps,
            isinstance(module, nn.RMSNorm),
            module.weight is not None,
            getattr(module, "bias", None) is not None,
        )
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if "RMSNorm" in name and isinstance(weight, Tensor) and weight.dim() == 1:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if isinstance(eps, float | int):
            return NormKind(weight.shape[0], float(eps), True, True, False)
    return None


def normalize_over_group(x: Tensor, hidden: int, eps: float, group, rms: bool = False) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` (or ``x / sqrt(mean(x^2) + eps)`` with ``rms``) over a
    hidden dim of width ``hidden`` split over ``group``; ``x`` is this rank's block.

    The statistics are all-reduced over the group, and each rank normalises its own
    block with them (so the gradients of the sums are summed back over the group).
    Computed in ``x``'s dtype: callers upcast.
    """
    if not rms:
        x = x - comm.all_reduce(x.sum(-1, keepdim=True), group) / hidden
    var = comm.all_reduce((x * x).sum(-1, keepdim=True), group) / hidden
    return x * torch.rsqrt(var + eps)
