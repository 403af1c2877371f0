"""Point the user's optimizer at the parameters the engine made, in place.

The engine replaces parameters (tensor-parallel shards of the dense ones, a
pipeline stage's materialised layers, ZeRO's sharded ones) after the user built
the optimizer. Rebinding keeps the optimizer *object*, its class, defaults and
every group's settings, so an LR scheduler built on it keeps driving it.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn
from torch.optim import Optimizer

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import get_shard_spec

logger = logging.getLogger("gridtrain")


def rebind_optimizer(
    optimizer: Optimizer | None,
    new_of: dict[int, nn.Parameter],
    drop_missing: bool = False,
    ctx: ParallelContext | None = None,
) -> Optimizer | None:
    """Replace every parameter of ``optimizer`` found in ``new_of`` (id(old) -> new).

    ``drop_missing``: parameters not in ``new_of`` leave their groups (another pipeline
    stage's); else they stay. Groups left empty are kept so the group count does not
    change. State already held for a replaced parameter moves with it, cut to the new
    parameter's shard (``ctx`` needed) when its shape was the dense one.
    """
    if optimizer is None:
        return None
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            q = new_of.get(id(p))
            if q is None:
                if drop_missing:
                    optimizer.state.pop(p, None)
                    continue
                q = p
            if id(q) in seen:  # two old parameters became one (a tie): keep it once
                continue
            seen[id(q)] = q
            if q is not p and p in optimizer.state:
                optimizer.state[q] = _moved_state(optimizer.state.pop(p), p, q, ctx)
            kept.append(q)
        group["params"] = kept
    return optimizer


def _moved_state(state: dict, old: Tensor, new: Tensor, ctx: ParallelContext | None) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.shape == old.shape and value.shape != new.shape:
            if ctx is None:
                raise ValueError(f"optimizer state '{key}' needs a context to be resharded")
            value = shard_tensor(value, get_shard_spec(new), ctx).to(new.device)
        out[key] = value
    return out
