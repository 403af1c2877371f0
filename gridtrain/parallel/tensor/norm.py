"""Normalisation over a hidden dim that is split over a group: what LayerNorm and RMSNorm
become under 2D, 2.5D and 3D, and how the planner recognises a norm it may replace.

Some norms scale by ``1 + weight`` (Gemma's RMSNorm, whose weight starts at 0): the planner
finds the form by probing a CPU copy of the norm once (``norm_offset``) and hands the grid
norm ``offset=1``; the weight is stored as the model stores it, so dense state dicts and
checkpoints keep the model's own values."""

from __future__ import annotations

import copy
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


def norm_offset(module: nn.Module) -> float:
    """What ``module`` adds to its weight before scaling: 0 (``weight * normalised``) or 1
    (``(1 + weight) * normalised``). torch's norms are 0; another norm is probed once on a
    CPU copy (random input and weight; cheap, and it works for a ``gt.lazy_init`` model).
    Raises ValueError when it computes neither form."""
    kind = norm_kind(module)
    if kind is None or type(module) in (nn.LayerNorm, nn.RMSNorm) or not kind.has_weight:
        return 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, kind.hidden, generator=g, dtype=torch.float64)
    w = 0.5 * torch.randn(kind.hidden, generator=g, dtype=torch.float64)
    probe = copy.deepcopy(module).to_empty(device="cpu").to(torch.float64)
    why = ""
    with torch.no_grad():
        probe.weight.copy_(w)
        if getattr(probe, "bias", None) is not None:
            probe.bias.zero_()
        try:
            y = probe(x).double()
        except Exception as err:  # noqa: BLE001 - a norm that cannot run alone is unknown
            y, why = None, f" (its forward fails on one input: {type(err).__name__})"
    centred = x if kind.rms else x - x.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + kind.eps)
    for offset in (0.0, 1.0):
        # rtol: some norms compute in float32 inside
        if y is not None and torch.allclose(y, normed * (offset + w), rtol=1e-4, atol=1e-5):
            return offset
    raise ValueError(
        f"{type(module).__name__} computes neither weight * x / rms(x) nor "
        f"(1 + weight) * x / rms(x){why}; under 2d/2.5d/3d gridtrain's norm over the split "
        "hidden dimension would replace it with a different function; use 1d, sequence or a "
        "pipeline for this model"
    )


def norm_over_group(
    x: Tensor, kind: NormKind, group, weight: Tensor | None, bias: Tensor | None, offset: float
) -> Tensor:
    """The grid norms' forward: ``x`` (this rank's block) normalised over ``group`` with
    statistics in at least fp32, times ``offset + weight``, plus ``bias``, in ``x``'s dtype.
    ``weight`` and ``bias`` are this block's, already gathered. ``offset`` != 0 scales
    before the cast, as Gemma does: in bf16, ``1 + w`` would lose a small weight's low bits."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = normalize_over_group(xf, kind.hidden, kind.eps, group, kind.rms)
    if offset and weight is not None:
        y = y * (offset + weight.to(y.dtype))
        weight = None
    y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y
