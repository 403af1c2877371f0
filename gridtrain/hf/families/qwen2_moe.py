"""Qwen2-MoE (sigmoid-gated shared expert beside the experts): its experts are spread by its own
expert plan; its causal LM adds the auxiliary loss of its modeling module's
``load_balancing_loss_func``, which gridtrain makes the global batch's under data parallelism
(``hf/moe/router_loss.py``)."""

from gridtrain.hf.families.registry import Family, register_family
from gridtrain.hf.moe.families import MoeFamily, RouterLoss

NOTE = "sigmoid-gated shared expert beside the experts"
FAMILY = register_family(
    Family("qwen2_moe", moe=MoeFamily(RouterLoss(), note=NOTE), note="Qwen2-MoE")
)
