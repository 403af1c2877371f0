"""Dense twins: how each parameter's shard maps into the dense (layout-free) tensor.

A parallel layer tags each sharded parameter with a *shard spec*, a sequence of
``(dim, mode)`` splits applied in order: the dense tensor is cut into
``world_size(mode)`` equal chunks along ``dim`` and this rank keeps chunk
``local_rank(mode)``; the next split cuts that chunk again. An untagged tensor
is replicated. From the specs alone, ``full_state_dict`` rebuilds dense tensors
(all-gathers in reverse order) and ``load_full_state_dict`` cuts them again, so
checkpoints move between any layouts and the model built with no parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode

ShardSpec = tuple[tuple[int, ParallelMode], ...]
_ATTR = "_gt_shard_spec"


def set_shard_spec(param: Tensor, *splits: tuple[int, ParallelMode]) -> Tensor:
    """Tag ``param`` as this rank's shard under ``splits`` (see module docstring); returns it."""
    setattr(param, _ATTR, tuple(splits))
    return param


def get_shard_spec(param: Tensor) -> ShardSpec:
    """The splits of ``param``; () for a replicated tensor."""
    return getattr(param, _ATTR, ())


def shard_tensor(full: Tensor, spec: ShardSpec, ctx: ParallelContext) -> Tensor:
    """This rank's shard of the dense tensor ``full``."""
    for dim, mode in spec:
        n = ctx.world_size(mode)
        if full.shape[dim] % n:
            raise ValueError(
                f"dense dim {dim} of size {full.shape[dim]} does not split {n} ways over {mode.name}"
            )
        full = full.chunk(n, dim=dim)[ctx.local_rank(mode)]
    return full.contiguous()


def full_tensor(shard: Tensor, spec: ShardSpec, ctx: ParallelContext) -> Tensor:
    """The dense tensor, rebuilt from every rank's shard (collective over the spec's groups)."""
    for dim, mode in reversed(spec):
        shard = comm.all_gather_raw(shard.detach(), dim, ctx.group(mode))
    return shard


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside engine wrappers (DDP, fp16 wrappers) that expose ``.module``."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or getattr(
        model, "gt_wrapper", False
    ):
        model = model.module
    return model


def _dense_items(model: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """(dense key, local tensor) pairs; a model may rename keys via ``dense_key(name)``."""
    model = unwrap(model)
    rename = getattr(model, "dense_key", None)
    for name, t in model.state_dict(keep_vars=True).items():
        yield (rename(name) if rename else name), t


def full_state_dict(model: nn.Module, ctx: ParallelContext | None = None) -> dict[str, Tensor]:
    """Dense keys and shapes, every pipeline stage's, on every rank (CPU tensors).

    Equal to ``state_dict()`` of the same model built with no parallelism.
    """
    ctx = ctx or get_context()
    local = {
        key: full_tensor(t, get_shard_spec(t), ctx).detach().cpu().clone()
        for key, t in _dense_items(model)
    }
    if ctx.world_size(ParallelMode.PIPELINE) == 1:
        return local
    stages: list[dict[str, Tensor] | None] = [None] * ctx.world_size(ParallelMode.PIPELINE)
    dist.all_gather_object(stages, local, group=ctx.group(ParallelMode.PIPELINE))
    merged: dict[str, Tensor] = {}
    for stage in stages:
        merged.update(stage)  # tied weights appear on two stages with equal values
    return merged


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, Tensor], ctx: ParallelContext | None = None
) -> None:
    """Load a dense state dict: each rank copies in its own shard of every tensor it holds."""
    ctx = ctx or get_context()
    missing = []
    for key, t in _dense_items(model):
        if key not in state_dict:
            missing.append(key)
            continue
        shard = shard_tensor(state_dict[key].to(t.device), get_shard_spec(t), ctx)
        if shard.shape != t.shape:
            raise ValueError(
                f"'{key}': dense shape {tuple(state_dict[key].shape)} gives shard "
                f"{tuple(shard.shape)} but this rank holds {tuple(t.shape)}"
            )
        t.copy_(shard)
    if missing:
        raise KeyError(f"full state dict lacks {len(missing)} keys, e.g. {missing[:5]}")


# ---- which group averages a parameter's gradient ------------------------------------------
_DP_ATTR = "_gt_dp_mode"


def set_dp_mode(param: Tensor, mode: ParallelMode) -> Tensor:
    """Override the group over which ``param``'s gradient is averaged (experts: EXPERT_DATA)."""
    setattr(param, _DP_ATTR, mode)
    return param


def get_dp_mode(param: Tensor, ctx: ParallelContext) -> ParallelMode:
    """The group over which ``param``'s gradient is averaged between replicas.

    DATA by default; SEQUENCE_DP under sequence parallelism (the sequence shards
    of one batch hold the same weights); whatever a layer set with ``set_dp_mode``.
    """
    default = ParallelMode.SEQUENCE_DP if ctx.tensor_mode == "sequence" else ParallelMode.DATA
    return getattr(param, _DP_ATTR, default)
