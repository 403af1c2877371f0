"""What gridtrain knows about a Hugging Face mixture-of-experts family, as data.

Which modules hold the experts and which of their tensors are per expert is the model's
own data (its expert-parallel plan, ``model.ep_plan``); what a family's file in
``gridtrain/hf/families/`` adds (``Family.moe``) is the rest: how the family's causal LM
computes its router losses from ``output_router_logits``, so that gridtrain can make them
the global batch's (``router_loss.py``). A family in the expert plan but not registered so
still has its experts spread; its router loss, when asked for under data parallelism, is
then each rank's own batch's (a warning says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.hf.families.registry import family_of as registered


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
    (None for every built-in family: none of them computes one)."""

    router_loss: RouterLoss | None
    z_loss: RouterLoss | None = None
    note: str = ""


def family_of(model) -> MoeFamily | None:
    """What the family registry (``gridtrain/hf/families/``: ``Family.moe``) holds for
    ``model``'s family, or None."""
    return registered(model).moe
