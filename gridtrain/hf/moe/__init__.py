"""Mixture-of-experts ``transformers`` models, expert-parallel from ``moe.expert_parallel_size``.

``gt.initialize`` calls ``parallelize_experts`` (through ``gridtrain.hf.prepare_model``,
before the tensor plan) for every Hugging Face model:

* experts modules from the model's expert plan (``experts.py``) are spread over the
  EXPERT group, each rank holding ``num_experts / ep`` experts of each layer, and
  dispatched to dropless by all-to-all; at ep 1 they stay as they are;
* in every case they are planned whole: the tensor planner keeps them (``gt_parallel``)
  and drops the experts' entries of the model's own tensor plan (experts are split by
  expert, never over TENSOR), so the meta trace never runs the model's expert kernels;
* the family's router loss becomes the global batch's under data parallelism
  (``router_loss.py``, per family in ``families.py``);
* a mixture-of-experts model without an expert plan, or a layout the experts cannot
  take, is refused by name (``PlanError``).
"""

from __future__ import annotations

import logging

from torch import nn

from gridtrain.hf.modes import whole_hidden_modes
from gridtrain.hf.moe.experts import (
    Placement,
    check_experts,
    expert_modules,
    keep_whole,
    spread,
)
from gridtrain.hf.moe.families import family_of
from gridtrain.hf.moe.layout import ExpertTable
from gridtrain.hf.moe.router_loss import install_router_loss
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError, pattern_matches

logger = logging.getLogger("gridtrain")

__all__ = ["ExpertTable", "parallelize_experts"]

# config fields that count the experts of a mixture-of-experts family
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def parallelize_experts(
    model: nn.Module, ctx: ParallelContext
) -> tuple[dict[int, nn.Parameter], ExpertTable | None]:
    """Spread ``model``'s experts over EXPERT (see the module doc); returns old parameter id ->
    new parameter (for the optimizer) and the layout for ``engine.plan`` (None: no experts)."""
    ep = ctx.world_size(ParallelMode.EXPERT)
    found = expert_modules(model)
    if not found:
        _refuse_unplanned(model, ep)
        return {}, None
    _check_layout(model, ctx, next(iter(found)))
    new_of: dict[int, nn.Parameter] = {}
    places: dict[str, Placement] = {}
    init = getattr(model, "_init_weights", None)
    for name, per_expert in found.items():
        module = model.get_submodule(name)
        if ep == 1:  # nothing spread: planned whole, run as the model's code runs it
            keep_whole(module, per_expert)
            continue
        num = check_experts(name, module, per_expert, ep)
        places[name], moved = spread(name, module, num, ctx, init)
        new_of.update(moved)
    _drop_expert_styles(model, list(found))
    install_router_loss(model, family_of(model), ctx)
    return new_of, ExpertTable(ep, ctx.world_size(ParallelMode.EXPERT_DATA), places, len(found))


def _check_layout(model: nn.Module, ctx: ParallelContext, first: str) -> None:
    if ctx.tensor_geometry.blocked:  # the experts take whole hidden states
        raise PlanError(
            f"'{first}' ({type(model.get_submodule(first)).__name__}): the experts of "
            f"{type(model).__name__} take whole hidden states; tensor mode "
            f"{ctx.tensor_mode!r} splits them (use tensor mode {whole_hidden_modes()} with "
            "mixture-of-experts models)"
        )
    if ctx.pipeline_parallel_size > 1 and getattr(model.config, "output_router_logits", False):
        raise PlanError(
            f"{type(model).__name__}: config.output_router_logits under pipeline parallelism: "
            "each stage sees only its own layers' router logits; turn it off or use no pipeline"
        )


def _refuse_unplanned(model: nn.Module, ep: int) -> None:
    """A model with experts but no expert plan cannot be spread; ep > 1 then is an error."""
    if ep == 1:
        return
    cfg = getattr(model, "config", None)
    counts = {k: getattr(cfg, k) for k in EXPERT_COUNTS if isinstance(getattr(cfg, k, None), int)}
    if not any(v > 1 for v in counts.values()):
        raise PlanError(
            f"moe.expert_parallel_size {ep}: {type(model).__name__} has no mixture-of-experts "
            "block to spread (set moe.expert_parallel_size = 1 for a dense model)"
        )
    name, block = _first_moe_module(model)
    raise PlanError(
        f"'{name}' ({type(block).__name__}): a mixture-of-experts block that gridtrain cannot "
        f"spread over moe.expert_parallel_size {ep}: {type(model).__name__} has no "
        "expert-parallel plan (ep_plan / base_model_ep_plan) naming fused [num_experts, ...] "
        "expert tensors and a module whose forward takes (hidden_states, top_k_index, "
        "top_k_weights)"
    )


def _first_moe_module(model: nn.Module) -> tuple[str, nn.Module]:
    """The first block holding experts: a module with a child whose class says ``Expert``
    (JetMoE's ``JetMoeMoE`` holds ``JetMoeParallelExperts``), else the first module whose
    class says ``MoE`` or ``Expert``; the model itself when none does."""
    for name, module in model.named_modules():
        if any("expert" in type(c).__name__.lower() for c in module.children()):
            return name, module
    for name, module in model.named_modules():
        lowered = type(module).__name__.lower()
        if name and ("moe" in lowered or "expert" in lowered):
            return name, module
    return "", model


def _drop_expert_styles(model: nn.Module, names: list[str]) -> None:
    """Leave the experts out of the model's own tensor plan (``_tp_plan``): its styles for them
    (``moe_tp_experts``, packed splits of the fused tensors) split experts over TENSOR, and
    gridtrain spreads them whole over EXPERT instead."""
    plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict):
        return

    def about_experts(pattern: str) -> bool:  # the module itself or a tensor inside it
        cut = pattern.split(".")
        return any(
            len(cut) >= len(n.split(".")) and pattern_matches(".".join(cut[: len(n.split("."))]), n)
            for n in names
        )

    kept = {p: s for p, s in plan.items() if not about_experts(p)}
    if len(kept) != len(plan):
        model._tp_plan = kept
