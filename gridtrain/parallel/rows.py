"""Which rows of a parameter a data-parallel rank owns under ZeRO, the same at every stage.

A parameter (this rank's tensor-parallel shard of it, or the whole weight without
tensor parallelism) is cut along dim 0 over the ranks of its data-parallel group
(``tags.get_dp_mode``) exactly as ``torch.chunk`` and FSDP2 cut it: chunks of
``c = ceil(rows / n)`` rows, rank ``r`` owning rows ``[r c, min((r + 1) c, rows))``,
possibly none. Stages 1 and 2 keep such rows as the optimizer's parameters (the fp32
masters); stage 3's FSDP2 parameters are DTensors whose local tensors are the same rows.
So optimizer state is laid out alike at every stage and a checkpoint describes any
rank's share as the dense chunks of its tensor-parallel shard intersected with its rows.

A tensor holding owned rows carries a ``ZeroRows`` tag (``set_zero_rows``): the group
and where the rows lie in the full local tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gridtrain.parallel.comm import all_gather_single
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

_ZERO_ROWS = "_gt_zero_rows"
_ZERO_OWNER = "_gt_zero_owner"


class ZeroRows(NamedTuple):
    """Rows ``[start, start + owned)`` of a full local tensor of ``rows`` rows, cut over ``mode``."""

    mode: ParallelMode
    start: int
    rows: int


def chunk_rows(rows: int, n: int) -> int:
    """Rows of one chunk when ``rows`` are cut ``n`` ways (torch.chunk, FSDP2)."""
    return -(-rows // n)


def owned_range(rows: int, n: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the rows rank ``rank`` of ``n`` owns."""
    c = chunk_rows(rows, n)
    lo = min(rank * c, rows)
    return lo, min(lo + c, rows)


def as_rows(t: Tensor) -> Tensor:
    """``t`` itself, a scalar as a tensor of one row (a view)."""
    return t.view(1) if t.dim() == 0 else t


def set_zero_rows(t: Tensor, mode: ParallelMode, start: int, rows: int) -> Tensor:
    setattr(t, _ZERO_ROWS, ZeroRows(mode, start, rows))
    return t


def get_zero_rows(t: Tensor) -> ZeroRows | None:
    """The tag of a tensor holding only its rank's rows; None for a whole tensor."""
    return getattr(t, _ZERO_ROWS, None)


def set_owner(rows: Tensor, param: Tensor) -> Tensor:
    """Tag the optimizer's tensor of owned rows with the model parameter they belong to."""
    setattr(rows, _ZERO_OWNER, param)
    return rows


def get_owner(t: Tensor) -> Tensor | None:
    """The model parameter whose rows ``t`` holds (stages 1-2), else None."""
    return getattr(t, _ZERO_OWNER, None)


def zero_world(t: Tensor, ctx: ParallelContext) -> int:
    """Ranks among which ``t``'s rows are divided (1 for a whole tensor)."""
    info = get_zero_rows(t)
    return ctx.world_size(info.mode) if info is not None else 1


def local(t: Tensor) -> Tensor:
    """The rows this rank holds: a DTensor's local tensor, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def owned_like(t: Tensor, info: ZeroRows, ctx: ParallelContext) -> Tensor:
    """Rows ``info`` assigns to this rank of the full local tensor ``t`` (a view)."""
    n, r = ctx.world_size(info.mode), ctx.local_rank(info.mode)
    lo, hi = owned_range(info.rows, n, r)
    return as_rows(t)[lo:hi]


@torch.no_grad()
def gather_rows(t: Tensor, info: ZeroRows, ctx: ParallelContext) -> Tensor:
    """The full local tensor from every rank's rows (collective over ``info.mode``)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    n = ctx.world_size(info.mode)
    if n == 1:
        return t
    c = chunk_rows(info.rows, n)
    send = t.new_zeros((c, *t.shape[1:]))
    send[: t.shape[0]].copy_(t)
    out = t.new_empty((n * c, *t.shape[1:]))
    all_gather_single(out, send, group=ctx.group(info.mode))
    return out[: info.rows]
