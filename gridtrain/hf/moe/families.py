"""What gridtrain knows about each Hugging Face mixture-of-experts family, as data.

Which modules hold the experts and which of their tensors are per expert is the model's
own data (its expert-parallel plan, ``model.ep_plan``); what is kept here is the rest:
how the family's causal LM computes its router losses from ``output_router_logits``, so
that gridtrain can make them the global batch's (``router_loss.py``). A family in the
expert plan but not here still has its experts spread; its router loss, when asked for
under data parallelism, is then each rank's own batch's (a warning says so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterLoss:
    """``aux = <function>(router_logits, model.<num_experts>, model.<top_k>, attention_mask)``,
    a function of the model's modeling module; ``loss += model.<coef> * aux`` with labels."""

    function: str = "load_balancing_loss_func"
    num_experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    coef: str = "router_aux_loss_coef"


@dataclass(frozen=True)
class MoeFamily:
    """One family: its load-balancing loss (None: it computes none) and its router z-loss
    (None for every family below: none of them computes one)."""

    router_loss: RouterLoss | None
    z_loss: RouterLoss | None = None
    note: str = ""


# model_type -> family; every entry checked against one process by tests/test_hf_moe_*.py
FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily(RouterLoss(), note="top-k softmax router, no shared expert"),
    "qwen2_moe": MoeFamily(RouterLoss(), note="sigmoid-gated shared expert beside the experts"),
    "qwen3_moe": MoeFamily(RouterLoss(), note="top-k softmax router, no shared expert"),
    "gpt_oss": MoeFamily(
        RouterLoss(), note="top-k router with a bias, biased experts, clamped SwiGLU"
    ),
    "deepseek_v3": MoeFamily(
        None, note="grouped sigmoid routing with a bias, shared experts; no auxiliary loss"
    ),
}


def family_of(model) -> MoeFamily | None:
    """The entry for ``model``'s ``config.model_type``, or None."""
    return FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
