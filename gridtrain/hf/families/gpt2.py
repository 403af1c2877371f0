"""GPT-2 (GPT2LMHeadModel, GPT2Model, GPT2For...): no ``_tp_plan`` nor ``_pp_plan``, so
gridtrain gives it both, and its attention takes its head count from attributes.

* Tensor plan: its fused ``c_attn`` (a ``Conv1D``, weight ``[in, out]``, output laid out
  ``[q | k | v]``) is ``packed_colwise`` with 3 blocks in every head-splitting mode, so
  each rank keeps whole heads of q, k and v; where Linears take column/row styles (1d)
  ``c_proj`` is row-parallel, the MLP a column/row pair, and ``lm_head`` (tied to ``wte``)
  gathers its logits; where the mode blocks the hidden dim (2d, 2.5d, 3d) every other
  Linear is the mode's own.
* Heads: its attention splits ``c_attn``'s output with ``split_size = hidden`` (the dense
  width); with heads split each rank's ``c_attn`` returns ``3 * hidden / split`` features,
  so ``split_size`` and ``num_heads`` become this rank's.
* Pipeline units (``PP_PLAN``): ``wte``, ``wpe``, every block, ``ln_f``, ``lm_head``.
"""

from __future__ import annotations

from torch import nn

from gridtrain.hf.families.registry import Family, register_family
from gridtrain.hf.patches import Undo, set_undoable
from gridtrain.hf.plans import base_prefix
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError

# GPT-2's units and their inputs / outputs, in transformers' _pp_plan form
PP_PLAN = {
    "transformer.wte": (["input_ids"], ["inputs_embeds"]),
    "transformer.wpe": (["position_ids"], ["position_embeds"]),
    "transformer.h": (["hidden_states"], ["hidden_states"]),
    "transformer.ln_f": (["hidden_states"], ["hidden_states"]),
    "lm_head": (["hidden_states"], ["logits"]),
}


def tensor_plan(model: nn.Module, ctx: ParallelContext) -> dict[str, str]:
    """gridtrain's plan for GPT-2 (module doc)."""
    cfg, p = model.config, base_prefix(model)
    if getattr(cfg, "add_cross_attention", False):
        raise PlanError(
            f"{type(model).__name__}: GPT-2 with cross-attention (add_cross_attention=True) "
            "has no gridtrain plan; give its styles in parallel.tensor.plan"
        )
    plan = {f"{p}h.*.attn.c_attn": "packed_colwise"}  # [q | k | v]: 3 blocks, whole heads
    if ctx.tensor_geometry.blocked:  # every other Linear is the mode's own; logits gathered
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


def localise(model: nn.Module, plan, split: int, undo: Undo) -> None:
    """Make every GPT-2 attention's ``split_size`` / ``num_heads`` this rank's."""
    if split == 1:
        return
    for module in model.modules():
        if hasattr(module, "c_attn") and hasattr(module, "split_size"):
            set_undoable(undo, module, "split_size", module.embed_dim // split)
            set_undoable(undo, module, "num_heads", module.num_heads // split)


def pipeline_plan(model: nn.Module) -> dict[str, tuple[list[str], list[str]]] | None:
    """``PP_PLAN`` for a model with the LM head's ``transformer`` base; None otherwise."""
    return dict(PP_PLAN) if hasattr(model, "transformer") else None


FAMILY = register_family(
    Family("gpt2", tensor_plan, localise, pipeline_plan, note="GPT-2: fused c_attn, no HF plans")
)
