"""Normalisation over a hidden dim that is split over a group: what LayerNorm and RMSNorm
become under 2D, 2.5D and 3D, and how the planner recognises a norm it may replace.

A norm is recognised by what it computes, not by its class: torch's ``nn.LayerNorm`` and
``nn.RMSNorm`` are known; any other module shaped like a norm (parameters at most a 1-D
``weight`` and ``bias``, a width from its weight or ``normalized_shape``, whatever its
name; Llama's and Cohere's norms, OLMo's weightless one) is probed once per class and
settings on a small CPU copy (``_probe``): LayerNorm or RMS, scaling by ``weight`` or by
``1 + weight`` (Gemma, whose weight starts at 0), with its epsilon. The grid norm is handed
that form; the weight is stored as the model stores it, so dense state dicts and
checkpoints keep the model's own values. A module named like a norm that computes none of
these forms is still a norm to the planner, which refuses it by name (``norm_offset``)."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gridtrain.parallel import comm

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps")
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12)  # tried when a norm keeps its epsilon in its code


@dataclass(frozen=True)
class NormKind:
    """What a dense norm module computes: ``rms`` (no centring) or LayerNorm, over ``hidden``,
    times ``offset + weight`` (``offset`` None: neither form; ``why`` says what it is)."""

    hidden: int
    eps: float
    rms: bool
    has_weight: bool
    has_bias: bool
    offset: float | None = 0.0
    why: str = ""


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> NormKind | None
_BY_SIGNATURE: dict = {}  # a probe's answer for every module of the same class and settings


def norm_kind(module: nn.Module) -> NormKind | None:
    """The norm ``module`` computes over its last dim (module docstring), or None."""
    if module in _KINDS:
        return _KINDS[module]
    if type(module) in (nn.LayerNorm, nn.RMSNorm) or _torch_forward(module):
        kind = _torch_kind(module)
    else:  # any other module, subclasses of torch's norms with their own forward included
        shape = _norm_shape(module)
        kind = None if shape is None else _probed(module, *shape)
    _KINDS[module] = kind
    return kind


def _torch_forward(module: nn.Module) -> bool:
    """A subclass of torch's norms that keeps torch's forward (Nemotron's ``LayerNorm1P``
    scales by ``1 + weight`` in its own, and is probed)."""
    return (isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward) or (
        isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward
    )


def weightless_norm(module: nn.Module) -> bool:
    """Whether ``module``, with no parameters and no known width (NanoChat's RMS norm: an
    ``eps`` and ``F.rms_norm``-like code), normalises its input over the last dim."""
    if any(True for _ in module.parameters()) or any(True for _ in module.children()):
        return False
    if _eps_attr(module) is None or getattr(module, "normalized_shape", None) is not None:
        return False
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    try:
        with torch.no_grad():
            y = copy.deepcopy(module).to(device="cpu")(x)
    except Exception:  # noqa: BLE001 - no module that runs alone on one tensor: no norm
        return False
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return False
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    return bool(torch.allclose(y.double() * rms, x, rtol=1e-3, atol=1e-3))


def _torch_kind(module: nn.LayerNorm | nn.RMSNorm) -> NormKind | None:
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        return None
    eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
    has_bias = getattr(module, "bias", None) is not None
    return NormKind(
        shape[0], eps, isinstance(module, nn.RMSNorm), module.weight is not None, has_bias
    )


def _norm_shape(module: nn.Module) -> tuple[int, bool, bool] | None:
    """(hidden, has weight, has bias) of a module shaped like a norm (module docstring)."""
    if type(module).__module__.startswith("torch.nn") or any(True for _ in module.buffers()):
        return None  # torch's other norms (batch, group...) and modules with running state
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(True for _ in module.children()):
        return None
    if any(p.dim() != 1 for p in params.values()):
        return None
    width = getattr(module, "normalized_shape", None)
    width = (width,) if isinstance(width, int) else width
    if "weight" in params:
        hidden = params["weight"].shape[0]
    elif isinstance(width, tuple | list) and len(width) == 1 and isinstance(width[0], int):
        hidden = width[0]
    else:
        return None
    if "bias" in params and params["bias"].shape[0] != hidden:
        return None
    return hidden, "weight" in params, "bias" in params


def _eps_attr(module: nn.Module) -> float | None:
    for name in EPS_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def _signature(module: nn.Module) -> tuple:
    settings = tuple(
        (k, v)
        for k, v in sorted(vars(module).items())
        if not k.startswith("_") and isinstance(v, int | float | bool | str | tuple)
    )
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
    return type(module), shapes, settings


def _probed(module: nn.Module, hidden: int, has_weight: bool, has_bias: bool) -> NormKind | None:
    key = _signature(module)
    if key not in _BY_SIGNATURE:
        _BY_SIGNATURE[key] = _probe(module, hidden, has_weight, has_bias)
    return _BY_SIGNATURE[key]


def _probe(module: nn.Module, hidden: int, has_weight: bool, has_bias: bool) -> NormKind | None:
    """Run a float64 CPU copy of ``module`` on rows of unit and of small spread (where the
    epsilon shows) with a random weight and bias, and name the form it computed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, hidden, generator=g, dtype=torch.float64)
    x = torch.cat([x, 3e-3 * x + 1e-3])
    w, b = (0.5 * torch.randn(hidden, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        y = _run_copy(module, x, w if has_weight else None, b if has_bias else None)
    except Exception as err:  # noqa: BLE001 - a module that cannot run alone is no norm we know
        return _unknown(module, hidden, has_weight, has_bias, f" (it fails alone: {err!r:.80})")
    attr = _eps_attr(module)
    for eps in ((attr,) if attr is not None else ()) + COMMON_EPS:
        for rms in (True, False):
            centred = x if rms else x - x.mean(-1, keepdim=True)
            normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
            for offset in (0.0, 1.0) if has_weight else (0.0,):
                want = normed * (offset + w) if has_weight else normed
                want = want + b if has_bias else want
                # rtol: some norms compute in float32 inside
                if y.shape == want.shape and torch.allclose(y, want, rtol=1e-4, atol=1e-5):
                    return NormKind(hidden, eps, rms, has_weight, has_bias, offset)
    return _unknown(module, hidden, has_weight, has_bias, "")


def _run_copy(module: nn.Module, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    probe = copy.deepcopy(module)
    if any(t.is_meta for t in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    probe = probe.to(device="cpu", dtype=torch.float64)
    with torch.no_grad():
        for name, value in (("weight", w), ("bias", b)):
            if value is not None:
                getattr(probe, name).copy_(value)
        y = probe(x)
    if not isinstance(y, Tensor):
        raise TypeError(f"returns {type(y).__name__}")
    return y.double()


def _unknown(module, hidden: int, has_weight: bool, has_bias: bool, why: str) -> NormKind | None:
    """A module named like a norm stays a norm the planner refuses by name; any other is
    no norm."""
    name = type(module).__name__
    if "Norm" not in name or not has_weight:
        return None
    eps = _eps_attr(module) or 1e-6
    return NormKind(
        hidden,
        eps,
        "RMS" in name,
        has_weight,
        has_bias,
        offset=None,
        why=f"{name} computes neither weight * x / rms(x) nor (1 + weight) * x / rms(x) (nor "
        f"LayerNorm's forms){why}",
    )


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
    (``(1 + weight) * normalised``), as probed (module docstring). Raises ValueError when it
    computes neither form."""
    kind = norm_kind(module)
    if kind is None or not kind.has_weight:
        return 0.0
    if kind.offset is None:
        raise ValueError(
            f"{kind.why}; under 2d/2.5d/3d gridtrain's norm over the split hidden dimension "
            "would replace it with a different function; use 1d, sequence or a pipeline for "
            "this model"
        )
    return kind.offset


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
