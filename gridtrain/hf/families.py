"""What a Hugging Face family computes in the layers gridtrain replaces, kept once they are replaced.

The planner replaces an ``nn.Embedding`` by the mode's embedding and, under 2d/2.5d/3d,
every norm by the grid's norm (``weight * x / rms(x)`` or LayerNorm over a hidden dim
split across ranks). Some families compute a little more in those layers:

* **Scaled embeddings** (Gemma: ``embed_tokens`` multiplies the rows it looks up by
  ``sqrt(hidden)``, its ``embed_scale``): the replacing embedding gets a forward hook
  applying the same factor.
* **Norms scaling by ``1 + weight``** (Gemma's RMSNorm, whose weight starts at 0): the
  replacing grid norm runs with ``1 + weight`` in place of its weight.

``check`` finds them before the plan is applied, and refuses by name what it cannot
keep: an embedding whose ``forward`` does more than look up (and scale) rows, or a norm
computing neither form. Norms are told apart by probing a CPU copy of each once (random
input, random weight; cheap, and it also works for a model built under
``gt.lazy_init()``). ``restore`` installs the fixes once the plan is applied.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import Tensor, nn

from gridtrain.hf.plans import GRID_MODES
from gridtrain.parallel.tensor.norm import NormKind, norm_kind
from gridtrain.parallel.tensor.plan import PlanError

SCALE, OFFSET = "scale", "offset"
# model -> {path: (fix, its argument, the module found there)}, from check to restore
_FIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(model: nn.Module, mode: str | None) -> None:
    """Record the fixes ``model`` needs under tensor ``mode``; raise PlanError naming a module
    whose computation a replacement would change (module docstring)."""
    fixes: dict[str, tuple[str, object, nn.Module]] = {}
    if mode not in (None, "sequence"):
        for name, module in model.named_modules():
            if (
                isinstance(module, nn.Embedding)
                and type(module).forward is not nn.Embedding.forward
            ):
                fixes[name] = (SCALE, _embedding_scale(name, module), module)
    if mode in GRID_MODES:
        for name, module in model.named_modules():
            kind = norm_kind(module)
            if kind is not None and type(module) not in (nn.LayerNorm, nn.RMSNorm):
                if _norm_form(name, module, kind) == OFFSET:
                    fixes[name] = (OFFSET, None, module)
    _FIXES[model] = fixes


def restore(model: nn.Module) -> None:
    """Apply the fixes ``check`` recorded to the modules that now sit at those paths."""
    for name, (fix, arg, original) in _FIXES.pop(model, {}).items():
        module = model.get_submodule(name)
        if module is original:  # the plan kept it: its own forward still runs
            continue
        if fix == SCALE:
            module.register_forward_hook(_scale_hook(arg))
        else:
            module.forward = _one_plus_weight(module)


def _embedding_scale(name: str, module: nn.Embedding) -> Tensor:
    scale = getattr(module, "embed_scale", None)
    if not isinstance(scale, Tensor) or scale.numel() != 1:
        raise PlanError(
            f"'{name}' ({type(module).__name__}) computes more than an embedding lookup in its "
            "forward, and the tensor-parallel embedding replacing it would drop that; keep it "
            "whole with parallel.tensor.plan = {'" + name + "': 'replicate'} (1d) or use a "
            "layout without tensor splitting"
        )
    if scale.is_meta:  # gt.lazy_init(): the value the model's own init gives the buffer
        return torch.tensor(float(module.scalar_embed_scale), dtype=scale.dtype)
    return scale.detach().clone()


def _scale_hook(scale: Tensor):
    def hook(module: nn.Module, args, out: Tensor) -> Tensor:
        return out * scale.to(out.dtype).to(out.device)

    return hook


def _norm_form(name: str, module: nn.Module, kind: NormKind) -> str:
    """``"plain"`` (weight * normalised), ``OFFSET`` ((1 + weight) * normalised), or PlanError."""
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
    for form, scale in (("plain", w), (OFFSET, 1 + w)):
        # rtol: some norms compute in float32 inside
        if y is not None and torch.allclose(y, normed * scale, rtol=1e-4, atol=1e-5):
            return form
    raise PlanError(
        f"'{name}' ({type(module).__name__}) computes neither weight * x / rms(x) nor "
        f"(1 + weight) * x / rms(x){why}; under 2d/2.5d/3d gridtrain's norm over the split "
        "hidden dimension would replace it with a different function; use 1d, sequence or a "
        "pipeline for this model"
    )


def _one_plus_weight(norm: nn.Module):
    """``norm``'s own forward computed with ``1 + weight`` (the gradient reaches the weight)."""
    forward = type(norm).forward

    def run(x: Tensor) -> Tensor:
        view = copy.copy(norm)  # shares every attribute; only its parameter table differs
        view._parameters = {**norm._parameters, "weight": norm.weight + 1}
        return forward(view, x)

    return run
