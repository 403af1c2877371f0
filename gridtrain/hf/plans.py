"""Which style each layer of a Hugging Face model gets, and the checks that come before.

* **A family registered in ``families/``** gets gridtrain's plan: GPT-2 has no ``_tp_plan``
  (``families/gpt2.py``: its fused ``c_attn`` split per head); Phi-3's gathers its fused
  ``qkv_proj`` / ``gate_up_proj`` outputs, which ``families/phi3.py`` splits as packed blocks.
* **Families with a ``_tp_plan``** (Llama, Qwen, Mistral, Gemma, GPT-NeoX, OLMo, ...): gridtrain
  uses it (HF pattern syntax, already prefixed by ``transformers``), HF's style names read as
  gridtrain's (``hf_styles``: ``colwise_rep`` is ``colwise_gather_output``...; Qwen3's
  ``replicated_with_grad_allreduce`` per-head norms are a gridtrain style), a vocabulary split
  that does not divide moved to the embedding dimension. ``parallel.tensor.plan`` overrides
  it module by module; a style gridtrain does not implement is refused only where it would
  apply.
* **Any other model** (OPT, BioGPT, Bloom, MPT, ...) gets the plan traced from its data flow,
  as a plain PyTorch model does, in every mode: the trace sees how the model cuts each
  projection's output (``parallel/tensor/cuts.py``), splits fused ``[q | k | v]`` or
  ``[gate | up]`` outputs as packed blocks, and refuses by name a fused projection it cannot
  follow.

Heads are checked before anything is built: query heads and key/value heads must
divide by the number of ways the mode splits them (the mode spec's ``head_split``: 1d the
tensor size; 2d and 2.5d the grid side q; 3d the cube side d), in the planner's words. Logits stay gathered by default, so
``out.logits.reshape(-1, V)`` is right in every mode.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gridtrain.hf.families import family_of
from gridtrain.hf.modes import takes_styles
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError, pattern_matches
from gridtrain.parallel.tensor.registry import spec_of
from gridtrain.parallel.tensor.style import from_hf


def hf_styles(plan: dict[str, str]) -> dict[str, str]:
    """A model's ``_tp_plan`` in gridtrain's style names: each style says the Hugging Face
    spellings it stands for (``Style.hf_names``); every other name is read as gridtrain's own,
    whose vocabulary holds HF's."""
    return {pattern: from_hf(style) for pattern, style in plan.items()}


def head_split(ctx: ParallelContext) -> tuple[int, str]:
    """(how many ways ``ctx``'s tensor mode splits attention heads, over which group in words):
    the mode spec's own answer, which the planner and ``gridtrain estimate`` use too."""
    tensor = ctx.world_size(ParallelMode.TENSOR)
    return spec_of(ctx).head_split(tensor, ctx.config.parallel.tensor.depth)


def base_prefix(model: nn.Module) -> str:
    """``"transformer."`` for GPT2LMHeadModel, ``""`` for a bare GPT2Model."""
    base = getattr(model, "base_model", model)
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def check_heads(model: nn.Module, ctx: ParallelContext) -> None:
    """Query and key/value head counts must divide by the mode's head split."""
    split, where = head_split(ctx)
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if split == 1 or heads is None:
        return
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for key, label, count in (
        ("num_attention_heads", "heads", heads),
        ("num_key_value_heads", "key/value heads", kv),
    ):
        if count % split:
            raise PlanError(
                f"{type(model).__name__} ({key}={count}): {count} attention {label} do not "
                f"split over {where}: {count} % {split} != 0 (choose a tensor size that divides "
                f"num_attention_heads={heads} and num_key_value_heads={kv})"
            )


def tensor_plan(model: nn.Module, ctx: ParallelContext) -> dict[str, str]:
    """The model's plan under ``ctx`` (HF pattern syntax); raises PlanError (see module doc)."""
    if ctx.tensor_geometry.splits_sequence:  # weights whole; attention must become a ring
        if not getattr(type(model), "_supports_attention_backend", False):
            raise PlanError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface (no _supports_attention_backend), so gridtrain cannot give "
                f"it ring attention; tensor mode {ctx.tensor_mode!r} needs that"
            )
        return {}
    check_heads(model, ctx)
    family = family_of(model)
    if family.tensor_plan is not None:  # gridtrain's plan for the family (families/)
        return family.tensor_plan(model, ctx)
    own = getattr(model, "_tp_plan", None) or getattr(model, "gt_tp_plan", None)
    if own:
        return fit_vocab(model, hf_styles(own), ctx)
    return {}  # traced, as any model: fused projections it cannot follow are refused there


def fit_vocab(model: nn.Module, plan: dict[str, str], ctx: ParallelContext) -> dict[str, str]:
    """Where Linears take column/row styles (1d), a vocabulary split that does not divide
    moves to the hidden dimension."""
    if not takes_styles(ctx.tensor_geometry):
        return plan
    n = ctx.world_size(ParallelMode.TENSOR)
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        hits = [m for name, m in modules.items() if pattern_matches(pattern, name)]
        rows = [_vocab_rows(m, style) for m in hits]
        if any(r is not None and r % n for r in rows):
            style = {"embedding_rowwise": "embedding_colwise"}.get(style, "rowwise_split_input")
        out[pattern] = style
    return out


def _vocab_rows(module: nn.Module, style: str) -> int | None:
    if style == "embedding_rowwise" and isinstance(module, nn.Embedding):
        return module.num_embeddings
    if style == "colwise_gather_output" and isinstance(module, nn.Linear):
        return module.out_features
    return None


def trace_example(example: Any) -> Any:
    """The example traced on meta without ``attention_mask``: HF's mask code reads mask values
    (``.all()``), which meta tensors do not have, and the data flow does not depend on it."""
    if isinstance(example, dict):
        return {k: v for k, v in example.items() if k != "attention_mask"}
    return example
