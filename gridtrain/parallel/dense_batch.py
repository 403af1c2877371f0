"""Many dense tensors at once: ``dense_state.dense_tensor`` for a list, with one all-gather per
group and dtype at each step instead of one per tensor.

A whole state dict (``gt.full_state_dict``, the optimizer's dense state, the dense
checkpoint) gathers every tensor: per tensor, its ZeRO rows over the data-parallel group,
then each split of its shard spec in reverse order. Here the tensors that take the same
step over the same group are flattened into one buffer and gathered together (a 3d layout's
state dict: 3 collectives a step instead of ~150). Each rank of a group holds the same
tensors in the same order with equal shard shapes (ZeRO rows padded as ``gather_rows`` pads
them), so every rank builds the same buffers; the buckets run in a fixed order, as the
per-tensor loop did. Tensors go in chunks of at most ``CHUNK_BYTES`` dense bytes: a chunk's
gathered tensors sit on the compute device until they are copied to CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.rows import ZeroRows, chunk_rows
from gridtrain.parallel.tags import ShardSpec, as_spec

CHUNK_BYTES = 256 << 20

# (tensor, its shard spec, the ZeRO rows it is held as or None)
Item = tuple[Tensor, ShardSpec, ZeroRows | None]


def _gather(xs: list[Tensor], dims: list[int], group) -> list[Tensor]:
    """Each ``xs[i]`` concatenated over ``group``'s ranks along ``dims[i]``: one collective."""
    moved = [x.movedim(d, 0).contiguous() for x, d in zip(xs, dims, strict=True)]
    flat = comm.all_gather_flat(torch.cat([m.view(-1) for m in moved]), group)
    out, offset = [], 0
    for m, d in zip(moved, dims, strict=True):
        piece = flat[:, offset : offset + m.numel()]
        offset += m.numel()
        out.append(piece.reshape(m.shape[0] * flat.shape[0], *m.shape[1:]).movedim(0, d))
    return out


def _buckets(keys: dict[int, tuple]) -> list[list[int]]:
    """Item indices grouped by key (group's mode, dtype, device), in a fixed order."""
    grouped: dict[tuple, list[int]] = {}
    for i, key in keys.items():
        grouped.setdefault(key, []).append(i)
    return [grouped[k] for k in sorted(grouped, key=lambda k: tuple(map(str, k)))]


def dtensor_full(t: DTensor, ctx: ParallelContext) -> Tensor:
    """The whole value of a DTensor (FSDP2's own gather), through the compute device when
    its shards live in CPU memory (offload: collectives run on the device)."""
    mine = t.to_local()
    if mine.device != ctx.device:
        t = DTensor.from_local(
            mine.to(ctx.device),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.full_tensor()


def _gather_rows(ts: list[Tensor], rows: list[ZeroRows | None], ctx) -> list[Tensor]:
    """Each tensor's whole tensor-parallel shard from its ZeRO rows (``full_local``)."""
    out = [dtensor_full(t, ctx) if isinstance(t, DTensor) else t for t in ts]
    keys = {
        i: (r.mode.name, t.dtype, t.device)
        for i, (t, r) in enumerate(zip(ts, rows, strict=True))
        if r is not None and not isinstance(t, DTensor) and ctx.world_size(r.mode) > 1
    }
    for idx in _buckets(keys):
        mode = rows[idx[0]].mode
        n = ctx.world_size(mode)
        sends = []
        for i in idx:
            send = ts[i].new_zeros((chunk_rows(rows[i].rows, n), *ts[i].shape[1:]))
            send[: ts[i].shape[0]].copy_(ts[i])
            sends.append(send)
        for i, full in zip(idx, _gather(sends, [0] * len(idx), ctx.group(mode)), strict=True):
            out[i] = full[: rows[i].rows]
    return out


def _gather_splits(ts: list[Tensor], specs: list[list], ctx) -> list[Tensor]:
    """``sharding.full_tensor`` of each: level k gathers every spec's k-th split from the end."""
    out = list(ts)
    for level in range(max(map(len, specs), default=0)):
        keys = {}
        for i, spec in enumerate(specs):
            if level < len(spec) and ctx.world_size(spec[-1 - level][1]) > 1:
                keys[i] = (spec[-1 - level][1].name, out[i].dtype, out[i].device)
        for idx in _buckets(keys):
            xs, dims = [], []
            for i in idx:
                dim, _, parts = specs[i][-1 - level]
                dim = dim % out[i].dim()
                xs.append(out[i].unflatten(dim, (parts, out[i].shape[dim] // parts)))
                dims.append(dim + 1)
            group = ctx.group(specs[idx[0]][-1 - level][1])
            for i, full, d in zip(idx, _gather(xs, dims, group), dims, strict=True):
                out[i] = full.flatten(d - 1, d)
    return out


def _dense_bytes(item: Item, ctx: ParallelContext) -> int:
    """The dense tensor's size, equal on every rank (not the local shard's: ZeRO rows differ)."""
    t, spec, rows = item
    shape = list(t.shape)
    if rows is not None and not isinstance(t, DTensor) and shape:
        shape[0] = rows.rows
    factor = math.prod(ctx.world_size(mode) for _, mode, _ in as_spec(spec))
    return math.prod(shape) * factor * t.element_size()


def _chunks(items: list[Item], ctx: ParallelContext) -> list[list[int]]:
    chunks, size = [[]], 0
    for i, item in enumerate(items):
        nbytes = _dense_bytes(item, ctx)
        if chunks[-1] and size + nbytes > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nbytes
    return chunks


def dense_tensors(items: list[Item], ctx: ParallelContext) -> list[Tensor]:
    """``dense_tensor(t, spec, ctx, rows)`` of each item (detached CPU copies). Collective:
    every rank of each group passes the same items in the same order."""
    out: list[Tensor] = [None] * len(items)  # type: ignore[list-item]
    for chunk in _chunks(items, ctx):
        ts = [items[i][0].detach() for i in chunk]
        ts = _gather_rows(ts, [items[i][2] for i in chunk], ctx)
        ts = _gather_splits(ts, [list(as_spec(items[i][1])) for i in chunk], ctx)
        for i, t in zip(chunk, ts, strict=True):
            out[i] = t.cpu().clone()
    return out
