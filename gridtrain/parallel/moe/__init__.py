"""Mixture of experts with expert parallelism: routers, stacked FFN experts, the MoE layer.

``moe = dict(expert_parallel_size=N)`` in the config spreads each layer's experts
over N data-parallel ranks (the EXPERT group); expert gradients are averaged over
EXPERT_DATA, everything else over DATA.
"""

from gridtrain.parallel.moe.experts import Experts, scale_grad
from gridtrain.parallel.moe.layer import (
    MoeLayer,
    clear_aux_loss,
    collect_aux_loss,
    expert_load,
    moe_layers,
    pending_aux_loss,
)
from gridtrain.parallel.moe.router import (
    Router,
    RouterOutput,
    Top1Router,
    Top2Router,
    capacity,
    load_balancing_loss,
    router_z_loss,
)

aux_loss = collect_aux_loss  # the name the issue uses

__all__ = [
    "Experts",
    "MoeLayer",
    "Router",
    "RouterOutput",
    "Top1Router",
    "Top2Router",
    "aux_loss",
    "capacity",
    "clear_aux_loss",
    "collect_aux_loss",
    "expert_load",
    "load_balancing_loss",
    "moe_layers",
    "pending_aux_loss",
    "router_z_loss",
    "scale_grad",
]
