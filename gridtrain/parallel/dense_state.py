"""The one dense-state path: a model's tensors as the same model built with no parallelism.

``gt.full_state_dict`` and ``gt.load_full_state_dict`` are these functions, and the
checkpoints use them (the dense format for the model, its fp32 masters and its optimizer
state). A rank holds each tensor in one or more of these ways, each undone here:

* a tensor-parallel shard (its shard spec, ``sharding``): all-gathered over the spec's
  groups, cut again on load;
* ZeRO rows (stages 1-2: a tensor tagged ``ZeroRows``, ``parallel.rows``): this rank's
  rows of its tensor-parallel shard, gathered over the data-parallel group;
* a ``DTensor`` (FSDP2: ZeRO 3 and Gemini; any implementation that holds parameters as
  DTensors): ``full_tensor`` (through the compute device when the shards live in CPU
  memory), and on load ``distribute_tensor`` without communication (each rank already
  holds the whole value and keeps its own piece);
* a master copy (naive fp16's fp32 masters, ZeRO 1-2's copied or offloaded rows): the
  tensor the optimizer steps is tagged on the parameter with ``set_master``; it is read
  instead of the parameter, and a load writes both, so no later step copies stale masters
  back over loaded weights;
* a pipeline stage: each stage gathers its own tensors, then the stages' dicts merge.

An implementation that holds parameters its own way (an offload runtime) is served by
keeping each model parameter, whenever no forward or backward runs, as one of the above
with its gridtrain tags (``tags.copy_tags`` from the parameter it replaced): the whole
tensor-parallel shard, a DTensor, or this rank's rows tagged with
``rows.set_zero_rows``; ``set_master`` where the optimizer steps a separate copy;
and by treating writes into them (a load) as new weights before the next forward.

Whole-model calls gather all tensors at once (``dense_values``: ``dense_batch`` takes one
collective per group and step, not one per tensor) and load them with the per-tensor
``load_local``; a streaming writer or reader (``gridtrain.hf``'s safetensors) calls the
per-tensor ones (``dense_value``, ``load_local``) one tensor at a time;
``held_rows`` / ``load_rows`` let a reader fetch only the rows a rank keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.dense_batch import dense_tensors, dtensor_full
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import (
    ZeroRows,
    gather_rows,
    get_zero_rows,
    owned_like,
    owned_range,
)
from gridtrain.parallel.sharding import dense_items, dense_shape, shard_tensor
from gridtrain.parallel.tags import ShardSpec, get_shard_spec

_MASTER = "_gt_master"


def set_master(param: Tensor, master: Tensor) -> Tensor:
    """Tag ``param`` with the tensor the optimizer steps for it (an fp32 copy of it, or of
    this rank's rows of it); returns ``param``. The master is what dense state reads."""
    setattr(param, _MASTER, master)
    return param


def get_master(param: Tensor) -> Tensor | None:
    """The master copy of ``param`` (``set_master``), or None when ``param`` is stepped itself."""
    return getattr(param, _MASTER, None)


# ---- one tensor ------------------------------------------------------------------------------
def full_local(t: Tensor, ctx: ParallelContext, rows: ZeroRows | None = None) -> Tensor:
    """This rank's whole tensor-parallel shard of ``t``, however ZeRO holds it (collective
    over the data-parallel group when it holds rows). ``rows``: the tag of the parameter
    ``t`` is shaped like, for optimizer state (default: ``t``'s own)."""
    if isinstance(t, DTensor):
        return dtensor_full(t, ctx)
    rows = rows if rows is not None else get_zero_rows(t)
    return t if rows is None else gather_rows(t, rows, ctx)


def dense_tensor(
    t: Tensor, spec: ShardSpec, ctx: ParallelContext, rows: ZeroRows | None = None
) -> Tensor:
    """The dense tensor of which ``t`` holds this rank's part (a detached CPU copy).
    Collective over the groups of ``spec`` and ``t``'s ZeRO group."""
    rows = rows if rows is not None else get_zero_rows(t)  # a tag: read before detach
    return dense_tensors([(t, spec, rows)], ctx)[0]


def held_like(full: Tensor, like: Tensor, ctx: ParallelContext, rows: ZeroRows | None = None):
    """``full`` (a whole tensor-parallel shard) held as ``like`` holds its value: a DTensor of
    this rank's piece, this rank's ZeRO rows (``rows``, default ``like``'s tag), or whole.
    A new tensor on ``like``'s device in ``full``'s dtype; no communication."""
    if isinstance(like, DTensor):
        piece = distribute_tensor(
            full.to(ctx.device), like.device_mesh, like.placements, src_data_rank=None
        ).to_local()
        return DTensor.from_local(
            piece.to(like.to_local().device),
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    rows = rows if rows is not None else get_zero_rows(like)
    if rows is not None:
        full = owned_like(full, rows, ctx).view(like.shape)
    return full.to(like.device, copy=True)


@torch.no_grad()
def copy_full_local(t: Tensor, full: Tensor, ctx: ParallelContext) -> None:
    """Write the whole tensor-parallel shard ``full`` into ``t``, keeping what ``t`` holds."""
    value = held_like(full, t, ctx)
    if isinstance(t, DTensor):
        t.to_local().copy_(value.to_local())
    else:
        t.copy_(value)


# ---- a whole model -----------------------------------------------------------------------------
def merge_stages(local: dict, ctx: ParallelContext) -> dict:
    """Every pipeline stage's entries of ``local`` on every rank (collective over PIPELINE)."""
    if ctx.world_size(ParallelMode.PIPELINE) == 1:
        return local
    merged: dict = {}
    for stage in comm.all_gather_object(local, ctx.group(ParallelMode.PIPELINE)):
        merged.update(stage)  # tied weights appear on two stages with equal values
    return merged


def dense_dtype(t: Tensor) -> torch.dtype:
    """The dtype ``dense_value`` gives ``t``: the wider of its own and its master's (fp32 masters
    of fp16 weights, fp64 of fp32 offload rows)."""
    master = get_master(t)
    return t.dtype if master is None else torch.promote_types(t.dtype, master.dtype)


def dense_value(t: Tensor, ctx: ParallelContext) -> Tensor:
    """The dense value of the model tensor ``t`` (its master's where it has one), as a CPU
    tensor of ``dense_dtype(t)``. Collective over ``t``'s tensor-parallel and ZeRO groups."""
    return dense_values([t], ctx)[0]


def dense_values(tensors: list[Tensor], ctx: ParallelContext) -> list[Tensor]:
    """``dense_value`` of each model tensor, with one collective per group and step for all
    of them (``dense_batch``). Collective: every rank passes its model's tensors in order."""
    sources = [t if get_master(t) is None else get_master(t) for t in tensors]
    items = [
        (s, get_shard_spec(t), get_zero_rows(s)) for s, t in zip(sources, tensors, strict=True)
    ]
    dense = dense_tensors(items, ctx)
    return [d.to(dense_dtype(t)) for d, t in zip(dense, tensors, strict=True)]


def full_state_dict(model: nn.Module, ctx: ParallelContext | None = None) -> dict[str, Tensor]:
    """The model's state as plain CPU tensors with the dense model's keys and shapes.

    Equal to ``state_dict()`` of the same model built with no parallelism, in every layout
    (tensor modes, pipeline stages, experts, ZeRO 1-3, Gemini), on every rank; under naive
    fp16 the fp32 master weights. Collective: call on every rank.
    """
    ctx = ctx or get_context()
    items = list(dense_items(model))
    values = dense_values([t for _, t in items], ctx)
    local = {key: value for (key, _), value in zip(items, values, strict=True)}
    return merge_stages(local, ctx)


def held_rows(t: Tensor, ctx: ParallelContext) -> tuple[int, int] | None:
    """``[lo, hi)``: the rows of its whole tensor-parallel shard that ``t`` holds, where it
    holds only those (ZeRO 3's DTensors, Gemini's rows) and no master; else None. A loader
    then reads just these rows and writes them with ``load_rows``."""
    rows = get_zero_rows(t)
    if rows is None or t.dim() == 0 or get_master(t) is not None:
        return None
    return owned_range(rows.rows, ctx.world_size(rows.mode), ctx.local_rank(rows.mode))


@torch.no_grad()
def load_rows(t: Tensor, value: Tensor) -> None:
    """Write the rows ``held_rows(t)`` names (``value``) into ``t``."""
    mine = t.to_local() if isinstance(t, DTensor) else t
    mine.copy_(value.view(mine.shape))


@torch.no_grad()
def load_local(t: Tensor, full: Tensor, ctx: ParallelContext) -> None:
    """Write ``full``, the whole tensor-parallel shard of the model tensor ``t``, into ``t``
    and its master, each keeping what it holds (no communication)."""
    copy_full_local(t, full, ctx)
    master = get_master(t)
    if master is not None:
        copy_full_local(master, full, ctx)


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, Tensor], ctx: ParallelContext | None = None
) -> None:
    """Load a dense state dict (``full_state_dict``'s, or a model built with no parallelism):
    each rank keeps its own part of every tensor it holds, masters included.

    Every key and shape is checked before anything is copied, so a mismatch leaves the
    model untouched. Needs no communication; call it on every rank.
    """
    ctx = ctx or get_context()
    items = list(dense_items(model))
    missing = [key for key, _ in items if key not in state_dict]
    if missing:
        raise KeyError(f"full state dict lacks {len(missing)} keys, e.g. {missing[:5]}")
    for key, t in items:
        want = dense_shape(t, ctx)
        if tuple(state_dict[key].shape) != want:
            raise ValueError(
                f"'{key}': dense shape {tuple(state_dict[key].shape)} differs from the "
                f"model's {want}"
            )
    for key, t in items:
        device = t.to_local().device if isinstance(t, DTensor) else t.device
        load_local(t, shard_tensor(state_dict[key].to(device), get_shard_spec(t), ctx), ctx)


__all__ = [
    "copy_full_local",
    "dense_dtype",
    "dense_tensor",
    "dense_value",
    "dense_values",
    "full_local",
    "full_state_dict",
    "get_master",
    "held_like",
    "held_rows",
    "load_full_state_dict",
    "load_local",
    "load_rows",
    "merge_stages",
    "set_master",
]
