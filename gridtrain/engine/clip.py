"""Global gradient-norm clipping that is tensor-, pipeline- and expert-parallel aware.

The dense model's squared norm is the sum over every distinct gradient shard of
its squared norm. Each rank adds ``||g||^2 / copies(param)`` for its parameters,
where ``copies`` is how many ranks hold an identical copy of that shard once
data-parallel gradients are synced, and one scalar all-reduce over GLOBAL sums
it: every distinct shard is then counted exactly once. The result equals
``torch.nn.utils.clip_grad_norm_`` on the dense model.

Under ZeRO a rank holds only its rows of a shard's gradient (stages 1-2: the
optimizer's row parameters; stage 3: FSDP2's DTensors, whose local rows are used):
the rows of the ranks of its data-parallel group are distinct, so ``copies`` divides
by that group's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import local, zero_world
from gridtrain.parallel.tags import get_shard_spec, is_pipeline_shared

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def copies(param: Tensor, ctx: ParallelContext) -> int:
    """Ranks holding an identical copy of ``param``'s shard after the data-parallel sync.

    Within one pipeline stage the data x tensor ranks hold ``prod(world sizes of
    the spec's modes)`` distinct shards, each as often as the rest; a tied
    weight tagged pipeline-shared (``tags.mark_pipeline_shared``) also lives on a second stage.
    ZeRO rows of a shard (``parallel.rows``) are split over the shard's data-parallel group.
    """
    replicas = ctx.world_size(ParallelMode.DATA) * ctx.world_size(ParallelMode.TENSOR)
    shards = math.prod(ctx.world_size(mode) for _, mode, _ in get_shard_spec(param))
    if replicas % shards:
        raise ValueError(
            f"a parameter's shard spec {get_shard_spec(param)} splits it {shards} ways, which does "
            f"not divide data x tensor = {replicas} ranks of a pipeline stage"
        )
    copies_of_shard = replicas // shards
    split = zero_world(param, ctx)
    if copies_of_shard % split:
        raise ValueError(
            f"a parameter's ZeRO rows are split {split} ways, which does not divide the "
            f"{copies_of_shard} copies of its shard"
        )
    return copies_of_shard // split * (2 if is_pipeline_shared(param) else 1)


def global_grad_norm(params: Iterable[Tensor], ctx: ParallelContext) -> Tensor:
    """The 2-norm of the dense model's gradient (fp32 scalar on ``ctx.device``, same on all ranks)."""
    total = torch.zeros((), dtype=torch.float32, device=ctx.device)
    seen: set[int] = set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        total += local(p.grad).detach().float().pow(2).sum().to(ctx.device) / copies(p, ctx)
    comm.all_reduce_(total, ctx.group(ParallelMode.GLOBAL))
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor], max_norm: float, ctx: ParallelContext) -> Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``; returns the norm before clipping.

    Collective over GLOBAL: every rank must call it. Gradients must be unscaled
    (no loss scale) and already averaged over their data-parallel groups.
    """
    params = list({id(p): p for p in params if p.grad is not None}.values())
    norm = global_grad_norm(params, ctx)
    coef = (max_norm / (norm + EPS)).clamp(max=1.0)
    for p in params:
        grad = local(p.grad)
        grad.mul_(coef.to(grad.device, grad.dtype))
    return norm
