"""Embeddings that compute more than a lookup (a subclass of ``nn.Embedding`` with its own
``forward``), kept computing it in every tensor mode.

* Under 2d, 2.5d and 3d the grid's embedding runs the module's own forward on this rank's
  block of the table (``parallel/tensor/base.own_forward``): OPT's learned positions (an
  offset on the ids), Gemma's ``embed_scale`` and any other such class. ``check`` plans them
  ``embedding_colwise``.
* Under 1d an embedding whose only extra is a scalar factor (Gemma's ``embed_tokens``:
  ``sqrt(hidden)``) is split like any other and the replacing layer gets a forward hook
  applying the same factor (``restore``); any other stays whole (``replicate``: its own
  forward runs). A config entry that would split such an embedding anyway is refused by name.

(Norms scaling by ``1 + weight``, Gemma's RMSNorm, are the planner's own business:
``parallel/tensor/norm.py``.)
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.plan import PlanError, match_patterns

# model -> {path: (its embedding scale, the module found there)}, from check to restore
_FIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(model: nn.Module, geometry: ModeGeometry, given: dict[str, str]) -> dict[str, str]:
    """The plan entries (HF patterns) of ``model``'s embeddings that do more than look up,
    under the tensor mode of ``geometry`` (module docstring); records the 1d hooks for
    ``restore``. ``given``:
    the config's plan, which wins; one that splits such an embedding under 1d, which its
    own forward would not survive, is a PlanError naming it."""
    fixes: dict[str, tuple[Tensor, nn.Module]] = {}
    entries: dict[str, str] = {}
    _FIXES[model] = fixes
    if geometry.name is None or geometry.splits_sequence:  # every rank keeps the table whole
        return entries
    custom = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward
    }
    styles = match_patterns(given, list(custom), "parallel.tensor.plan", strict=False)
    for name, module in custom.items():
        style = styles.get(name)
        if geometry.blocked:
            entries[name] = "embedding_colwise"  # the grid's embedding runs its own forward
        elif style != "replicate":
            scale = _embedding_scale(module)
            if scale is not None:
                fixes[name] = (scale, module)
            elif style is None:
                entries[name] = "replicate"
            else:
                raise PlanError(_split_error(name, module, style))
    return entries


def restore(model: nn.Module) -> None:
    """Apply the fixes ``check`` recorded to the modules that now sit at those paths."""
    for name, (scale, original) in _FIXES.pop(model, {}).items():
        module = model.get_submodule(name)
        if module is original:  # the plan kept it: its own forward still runs
            continue
        module.register_forward_hook(_scale_hook(scale))


def _embedding_scale(module: nn.Embedding) -> Tensor | None:
    """Gemma's scalar ``embed_scale``, where that is the module's only extra (else None)."""
    scale = getattr(module, "embed_scale", None)
    if not isinstance(scale, Tensor) or scale.numel() != 1:
        return None
    if scale.is_meta:  # gt.lazy_init(): the value the model's own init gives the buffer
        return torch.tensor(float(module.scalar_embed_scale), dtype=scale.dtype)
    return scale.detach().clone()


def _split_error(name: str, module: nn.Module, style: str) -> str:
    return (
        f"'{name}' ({type(module).__name__}) computes more than an embedding lookup in its "
        f"forward, and the tensor-parallel embedding parallel.tensor.plan asks for ({style}) "
        "would drop that; keep it whole with parallel.tensor.plan = {'" + name + "': "
        "'replicate'} (1d), or use 2d/2.5d/3d, whose embedding runs its own forward"
    )


def _scale_hook(scale: Tensor):
    def hook(module: nn.Module, args, out: Tensor) -> Tensor:
        return out * scale.to(out.dtype).to(out.device)

    return hook
