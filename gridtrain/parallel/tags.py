"""Every tag gridtrain puts on a parameter, as named get/set functions.

Tags are plain attributes on the tensor objects, so they survive
``nn.Module.to`` (same Parameter object) and are copied by ``copy_tags`` when a
tensor is replaced (materialising a meta model, fp16 master weights).

* shard spec: how this rank's shard maps into the dense tensor, a tuple of
  ``(dim, ParallelMode)`` splits applied in order (see ``parallel.sharding``);
* data-parallel mode: the group that averages the gradient (experts: EXPERT_DATA);
* pipeline shared / tie index: a weight held by the first and the last stage
  (tied embedding and head), and which tie of the dense model it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from gridtrain.parallel.mode import ParallelMode

if TYPE_CHECKING:
    from gridtrain.parallel.context import ParallelContext


class Split(NamedTuple):
    """One cut of a shard spec: ``dim`` into ``world_size(mode)`` chunks, this rank keeps chunk
    ``local_rank(mode)``. ``parts > 1``: ``dim`` packs that many equal blocks (fused q/k/v)
    and each block is cut that way, the rank keeping its chunk of every block."""

    dim: int
    mode: ParallelMode
    parts: int = 1


ShardSpec = tuple[Split, ...]

_SHARD_SPEC = "_gt_shard_spec"
_DP_MODE = "_gt_dp_mode"
_PIPELINE_SHARED = "_gt_pipeline_shared"
_PIPELINE_TIE = "_gt_pipeline_tie"
ALL = (_SHARD_SPEC, _DP_MODE, _PIPELINE_SHARED, _PIPELINE_TIE)


def as_spec(splits) -> ShardSpec:
    """``splits`` (``(dim, mode)`` or ``(dim, mode, parts)`` tuples) as a normalised spec."""
    return tuple(Split(*s) for s in splits)


def set_shard_spec(param: Tensor, *splits) -> Tensor:
    """Tag ``param`` as this rank's shard under ``splits``; returns it."""
    setattr(param, _SHARD_SPEC, as_spec(splits))
    return param


def get_shard_spec(param: Tensor) -> ShardSpec:
    """The splits of ``param``; () for a replicated tensor."""
    return getattr(param, _SHARD_SPEC, ())


def set_dp_mode(param: Tensor, mode: ParallelMode) -> Tensor:
    """Override the group over which ``param``'s gradient is averaged (experts: EXPERT_DATA)."""
    setattr(param, _DP_MODE, mode)
    return param


def get_dp_mode(param: Tensor, ctx: ParallelContext) -> ParallelMode:
    """The group over which ``param``'s gradient is averaged between replicas.

    Whatever a layer set with ``set_dp_mode``; else the tensor mode's (its geometry's
    ``data_parallel``): DATA, SEQUENCE_DP under sequence parallelism (the sequence shards
    of one batch hold the same weights).
    """
    return getattr(param, _DP_MODE, ctx.tensor_geometry.data_parallel)


def default_dp_mode(ctx: ParallelContext) -> ParallelMode:
    """The data-parallel group of untagged tensors (buffers, plain parameters)."""
    return ctx.tensor_geometry.data_parallel


def mark_pipeline_shared(param: Tensor, tie: int | None = None) -> Tensor:
    """Tag a weight that lives on the first and the last pipeline stage (summed gradients)."""
    setattr(param, _PIPELINE_SHARED, True)
    if tie is not None:
        setattr(param, _PIPELINE_TIE, tie)
    return param


def is_pipeline_shared(param: Tensor) -> bool:
    return bool(getattr(param, _PIPELINE_SHARED, False))


def pipeline_tie(param: Tensor) -> int:
    """Index of the tie in the dense model (pairs the copies of two stages); 0 if unset."""
    return getattr(param, _PIPELINE_TIE, 0)


def copy_tags(src: Tensor, dst: Tensor) -> Tensor:
    """Give ``dst`` every gridtrain tag ``src`` carries; returns ``dst``."""
    for name in ALL:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
    return dst
