"""Which style each layer of a Hugging Face model gets, and the checks that come before.

* **GPT-2** has no ``_tp_plan``: gridtrain gives it one. Its fused ``c_attn`` (a
  ``Conv1D``, weight ``[in, out]``, output laid out ``[q | k | v]``) is
  ``packed_colwise`` with 3 blocks in every head-splitting mode, so each rank keeps
  whole heads of q, k and v; under 1d ``c_proj`` is row-parallel, the MLP a
  column/row pair, and ``lm_head`` (tied to ``wte``) gathers its logits.
* **Families with a ``_tp_plan``** (Llama, Qwen, Mistral, Gemma, GPT-NeoX, OLMo, ...): gridtrain
  uses it (HF pattern syntax, already prefixed by ``transformers``), HF's style names read as
  gridtrain's (``hf_styles``: ``colwise_rep`` is ``colwise_gather_output``...; Qwen3's
  ``replicated_with_grad_allreduce`` per-head norms are a gridtrain style), a vocabulary split
  that does not divide moved to the embedding dimension. ``parallel.tensor.plan`` overrides
  it module by module; a style gridtrain does not implement is refused only where it would
  apply.
* **Phi-3** brings one that gathers its fused ``qkv_proj`` / ``gate_up_proj`` outputs;
  gridtrain splits them as packed blocks instead (``phi3_plan``).
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

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError, pattern_matches
from gridtrain.parallel.tensor.registry import spec_of
from gridtrain.parallel.tensor.style import from_hf

GRID_MODES = ("2d", "2.5d", "3d")


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
    mode = ctx.tensor_mode
    if mode == "sequence":  # weights replicated; attention must be reachable to make it a ring
        if not getattr(type(model), "_supports_attention_backend", False):
            raise PlanError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface (no _supports_attention_backend), so gridtrain cannot give "
                "it ring attention; tensor mode 'sequence' needs that"
            )
        return {}
    check_heads(model, ctx)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt2":
        return gpt2_plan(model, ctx)
    if model_type == "phi3":
        return phi3_plan(model, ctx)
    own = getattr(model, "_tp_plan", None) or getattr(model, "gt_tp_plan", None)
    if own:
        return fit_vocab(model, hf_styles(own), ctx)
    return {}  # traced, as any model: fused projections it cannot follow are refused there


def gpt2_plan(model: nn.Module, ctx: ParallelContext) -> dict[str, str]:
    """gridtrain's plan for GPT-2 (GPT2LMHeadModel, GPT2Model, GPT2For...)."""
    cfg, p = model.config, base_prefix(model)
    if getattr(cfg, "add_cross_attention", False):
        raise PlanError(
            f"{type(model).__name__}: GPT-2 with cross-attention (add_cross_attention=True) "
            "has no gridtrain plan; give its styles in parallel.tensor.plan"
        )
    plan = {f"{p}h.*.attn.c_attn": "packed_colwise"}  # [q | k | v]: 3 blocks, whole heads
    if ctx.tensor_mode in GRID_MODES:  # every other Linear is the mode's own; logits gathered
        plan["lm_head"] = "gather_output"
        return plan
    plan.update(
        {
            f"{p}h.*.attn.c_proj": "rowwise",
            f"{p}h.*.mlp.c_fc": "colwise",
            f"{p}h.*.mlp.c_proj": "rowwise",
        }
    )
    n = ctx.world_size(ParallelMode.TENSOR)
    if cfg.vocab_size % n == 0:  # vocabulary split, logits gathered (HF's colwise_gather_output)
        plan[f"{p}wte"], plan["lm_head"] = "embedding_rowwise", "colwise_gather_output"
    else:  # GPT-2's 50257 tokens: split the hidden dim of the tied table instead
        plan[f"{p}wte"], plan["lm_head"] = "embedding_colwise", "rowwise_split_input"
    return plan


def phi3_plan(model: nn.Module, ctx: ParallelContext) -> dict[str, str]:
    """Phi-3: its ``_tp_plan`` gathers the outputs of the fused ``qkv_proj`` and
    ``gate_up_proj`` (every rank then runs every head and the whole MLP activation);
    gridtrain splits them as packed blocks instead, so each rank keeps its heads of q, k
    and v and its part of gate and up. The q/k/v blocks are equal only without grouped
    key/value heads; with them ``qkv_proj`` keeps Phi-3's own gathered split."""
    cfg, p = model.config, base_prefix(model)
    plan = fit_vocab(model, hf_styles(model._tp_plan), ctx)
    plan[f"{p}layers.*.mlp.gate_up_proj"] = "packed_colwise"
    plan[f"{p}layers.*.mlp.down_proj"] = "rowwise"
    if cfg.num_key_value_heads == cfg.num_attention_heads:
        plan[f"{p}layers.*.self_attn.qkv_proj"] = "packed_colwise"
        plan[f"{p}layers.*.self_attn.o_proj"] = "rowwise"
    else:
        _refuse_unequal_packing(model, ctx)
    for name, module in model.named_modules():  # the planner reads the block count here
        if name.endswith(".mlp.gate_up_proj"):
            module.gt_packed = 2
        elif name.endswith(".self_attn.qkv_proj"):
            module.gt_packed = 3
    return plan


def _refuse_unequal_packing(model: nn.Module, ctx: ParallelContext) -> None:
    """A config plan must not split a grouped-query ``qkv_proj`` as equal packed blocks."""
    cfg = model.config
    given = getattr(ctx.config.parallel.tensor, "plan", None) or {}
    names = [n for n, _ in model.named_modules() if n.endswith(".self_attn.qkv_proj")]
    for pattern, style in given.items():
        hits = [n for n in names if pattern_matches(pattern, n)]
        if style == "packed_colwise" and hits:
            kv = cfg.num_key_value_heads
            raise PlanError(
                f"'{hits[0]}' packs {cfg.num_attention_heads} query heads and {kv} + {kv} "
                f"key/value heads: blocks of unequal width, which packed_colwise (equal blocks) "
                f"would split wrongly; leave it out of parallel.tensor.plan (gridtrain gathers "
                f"its output) or use num_key_value_heads = num_attention_heads"
            )


def fit_vocab(model: nn.Module, plan: dict[str, str], ctx: ParallelContext) -> dict[str, str]:
    """Under 1d, a vocabulary split that does not divide moves to the hidden dimension."""
    if ctx.tensor_mode != "1d":
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
