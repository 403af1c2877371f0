"""What a Hugging Face family computes in the layers gridtrain replaces, kept once they are replaced.

The planner replaces an ``nn.Embedding`` by the mode's embedding. Some families compute a
little more there: Gemma's ``embed_tokens`` multiplies the rows it looks up by
``sqrt(hidden)`` (its ``embed_scale``), so the replacing embedding gets a forward hook
applying the same factor. (Norms scaling by ``1 + weight``, Gemma's RMSNorm, are the
planner's own business: ``parallel/tensor/norm.norm_offset``.)

``check`` finds them before the plan is applied and refuses by name an embedding whose
``forward`` does more than look up (and scale) rows; ``restore`` installs the hooks once
the plan is applied.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from gridtrain.parallel.tensor.plan import PlanError, match_patterns

# model -> {path: (its embedding scale, the module found there)}, from check to restore
_FIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(model: nn.Module, mode: str | None, given: dict[str, str]) -> None:
    """Record the fixes ``model`` needs under tensor ``mode``; raise PlanError naming a module
    whose computation a replacement would change (module docstring). ``given``: the config's
    plan (HF patterns); an embedding it keeps whole (``replicate``) keeps its own forward."""
    fixes: dict[str, tuple[Tensor, nn.Module]] = {}
    if mode not in (None, "sequence"):
        custom = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward
        }
        kept = match_patterns(given, list(custom), "parallel.tensor.plan", strict=False)
        for name, module in custom.items():
            if kept.get(name) != "replicate":
                fixes[name] = (_embedding_scale(name, module), module)
    _FIXES[model] = fixes


def restore(model: nn.Module) -> None:
    """Apply the fixes ``check`` recorded to the modules that now sit at those paths."""
    for name, (scale, original) in _FIXES.pop(model, {}).items():
        module = model.get_submodule(name)
        if module is original:  # the plan kept it: its own forward still runs
            continue
        module.register_forward_hook(_scale_hook(scale))


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
