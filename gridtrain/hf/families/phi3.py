"""Phi-3: its ``_tp_plan`` gathers the outputs of the fused ``qkv_proj`` and ``gate_up_proj``
(every rank then runs every head and the whole MLP activation); gridtrain splits them as
packed blocks instead, so each rank keeps its heads of q, k and v and its part of gate and
up. The q/k/v blocks are equal only without grouped key/value heads; with them ``qkv_proj``
keeps Phi-3's own gathered split. Its attention cuts ``qkv_proj``'s output at the dense
query width, so where ``qkv_proj`` is split it gets this rank's head counts.
"""

from __future__ import annotations

from torch import nn

from gridtrain.hf.families.registry import Family, register_family
from gridtrain.hf.patches import Undo, set_undoable
from gridtrain.hf.plans import base_prefix, fit_vocab, hf_styles
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.plan import PlanError, pattern_matches


def tensor_plan(model: nn.Module, ctx: ParallelContext) -> dict[str, str]:
    """Phi-3's ``_tp_plan`` with its fused projections split as packed blocks (module doc)."""
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


class _LocalHeads:
    """A view of a model's config with this rank's query-head count; every other field
    (and later changes, such as the attention implementation) read through."""

    def __init__(self, config, num_attention_heads: int):
        self.__dict__.update(_config=config, num_attention_heads=num_attention_heads)

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def localise(model: nn.Module, plan, split: int, undo: Undo) -> None:
    """Phi-3's attention cuts ``qkv_proj``'s output at ``config.num_attention_heads *
    head_dim`` (the dense width): where ``qkv_proj`` is split as packed blocks, its attention
    gets this rank's head counts."""
    if split == 1:
        return
    packed = {n for n, e in plan.entries.items() if e.style == "packed_colwise"}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if f"{prefix}qkv_proj" in packed and hasattr(module, "num_key_value_heads"):
            set_undoable(undo, module, "num_key_value_heads", module.num_key_value_heads // split)
            local = _LocalHeads(module.config, module.config.num_attention_heads // split)
            set_undoable(undo, module, "config", local)


FAMILY = register_family(
    Family("phi3", tensor_plan, localise, note="Phi-3: fused projections split as packed blocks")
)
