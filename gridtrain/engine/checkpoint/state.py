"""What both checkpoint formats share: dense names, the optimizer's parameters, where this rank's
shard lies in the dense tensor, every RNG state of the rank, and the layout it ran under.

Under ZeRO a rank holds only some rows of its tensor-parallel shard
(``parallel.rows``): stages 1-2 in the optimizer's parameters and state,
stage 3 in FSDP2's DTensor parameters too. ``chunk_view`` describes exactly those rows
as chunks of the dense tensor, so the sharded format writes each rank's rows once and
reads any layout's rows back; the dense format gathers them first
(``parallel.dense_state``, the path of ``gt.full_state_dict``).
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import copy_full_local
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import (
    ZeroRows,
    get_owner,
    get_zero_rows,
    local,
)
from gridtrain.parallel.sharding import unwrap
from gridtrain.parallel.tags import ShardSpec, as_spec

logger = logging.getLogger("gridtrain")

# (global offsets, offsets inside the local tensor, sizes) of one hyper-rectangle
Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


# ---- names and the optimizer's view of the model -------------------------------------------
def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> dense key (a tied parameter gets its first name)."""
    model = unwrap(model)
    rename = getattr(model, "dense_key", None)
    return {id(p): (rename(n) if rename else n) for n, p in model.named_parameters()}


def inner(optimizer):
    """The torch optimizer inside an amp wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optim", optimizer)


def owner(optimizer, param: Tensor) -> Tensor:
    """The model parameter an optimizer parameter stands for (fp16 masters: the fp16 weight;
    ZeRO stages 1-2: the parameter whose rows it holds)."""
    zero_owner = get_owner(param)
    if zero_owner is not None:
        return zero_owner
    return optimizer.model_param_for(param) if hasattr(optimizer, "model_param_for") else param


def masters(optimizer) -> list[tuple[Tensor, Tensor]]:
    """(model param, fp32 master) pairs of naive fp16; [] otherwise."""
    return optimizer.masters() if optimizer is not None and hasattr(optimizer, "masters") else []


def optimizer_params(optimizer, model: nn.Module):
    """(flat index, group index, optimizer param, model param, dense name) per named parameter.

    The flat index counts every parameter of every group in order, as
    ``Optimizer.state_dict`` numbers them; a pipeline stage's empty placeholder
    parameters are counted but not yielded.
    """
    names = param_names(model)
    flat = 0
    for index, group in enumerate(inner(optimizer).param_groups):
        for p in group["params"]:
            model_param = owner(optimizer, p)
            if id(model_param) in names:
                yield flat, index, p, model_param, names[id(model_param)]
            elif model_param.numel() != 0:
                raise KeyError("the optimizer holds a parameter that is not in the model")
            flat += 1


def is_moment(value: Any, param: Tensor) -> bool:
    """Whether an optimizer state value is shaped like its parameter (cut as the parameter is)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape


def sync_model_from_masters(optimizer, ctx: ParallelContext) -> None:
    """After loading: write the masters into the model (naive fp16: copy; ZeRO: all-gather),
    or, where ZeRO's masters copy an fp32 model (``offload``), refresh them from the model."""
    if masters(optimizer):
        optimizer.sync_model_from_masters()
        return
    if optimizer is None:
        return
    for group in inner(optimizer).param_groups:
        for q in group["params"]:
            p = get_owner(q)
            if p is not None and q.dtype == p.dtype and q.data_ptr() != p.data_ptr():
                copy_full_local(q, p.data, ctx)


def hyperparameters(optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in inner(optimizer).param_groups]


# ---- where a shard lies in the dense tensor ----------------------------------------------------
def _take(segments: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The (global start, length) pieces of local range [start, start+length) of a dim."""
    out, pos = [], 0
    for begin, size in segments:
        lo, hi = max(start, pos), min(start + length, pos + size)
        if lo < hi:
            if out and out[-1][0] + out[-1][1] == begin + lo - pos:
                out[-1] = (out[-1][0], out[-1][1] + hi - lo)  # contiguous in the dense tensor
            else:
                out.append((begin + lo - pos, hi - lo))
        pos += size
    return out


def shard_chunks(
    local_shape: tuple[int, ...], spec: ShardSpec, ctx: ParallelContext
) -> tuple[tuple[int, ...], list[Chunk]]:
    """(dense shape, chunks) of this rank's shard of a tensor tagged with ``spec``.

    Each split keeps chunk ``local_rank`` of ``world_size`` equal chunks along its
    dim (of each of ``parts`` packed blocks), so along every dim the shard is a
    list of dense ranges, and the shard is their product: one hyper-rectangle,
    or one per packed block (fused q/k/v).
    """
    spec = as_spec(spec)
    dense = list(local_shape)
    for dim, mode, _ in spec:
        dense[dim] *= ctx.world_size(mode)
    ranges = [[(0, n)] for n in dense]  # per dim: (dense start, length), in local order
    for dim, mode, parts in spec:
        n, r = ctx.world_size(mode), ctx.local_rank(mode)
        total = sum(size for _, size in ranges[dim])
        block, piece = total // parts, total // parts // n
        ranges[dim] = [
            seg for b in range(parts) for seg in _take(ranges[dim], b * block + r * piece, piece)
        ]
    per_dim = []
    for dim, dim_ranges in enumerate(ranges):
        if sum(size for _, size in dim_ranges) != local_shape[dim]:
            raise ValueError(f"shard spec {spec} does not fit a shard of shape {local_shape}")
        local = itertools.accumulate([0] + [size for _, size in dim_ranges[:-1]])
        per_dim.append([(g, lo, size) for (g, size), lo in zip(dim_ranges, local)])
    chunks = [tuple(tuple(axis) for axis in zip(*combo)) for combo in itertools.product(*per_dim)]
    return tuple(dense), [c if c else ((), (), ()) for c in chunks]


def _rows_only(chunks: list[Chunk], rows: ZeroRows, owned: int) -> list[Chunk]:
    """The parts of ``chunks`` (of the full local tensor) inside rows ``[start, start+owned)``,
    with local offsets counted from ``start``."""
    out = []
    lo, hi = rows.start, rows.start + owned
    for glob, loc, size in chunks:
        a, b = max(loc[0], lo), min(loc[0] + size[0], hi)
        if a >= b:
            continue
        shift = a - loc[0]
        out.append(
            (
                (glob[0] + shift, *glob[1:]),
                (a - lo, *loc[1:]),
                (b - a, *size[1:]),
            )
        )
    return out


def chunk_view(
    t: Tensor, spec: ShardSpec, ctx: ParallelContext, rows: ZeroRows | None = None
) -> Tensor | None:
    """``t`` (same storage) described to DCP as chunks of the dense tensor.

    We use DCP's ``CheckpointableTensor`` protocol (new in the pinned torch 2.14): a plain local
    tensor carrying ``global_shape`` and, per chunk, its global offsets, its
    offsets inside the local tensor and its sizes. DTensor cannot express our
    splits (a 3d weight is cut twice along one dim by two groups, a fused q/k/v
    weight is one chunk per packed block), ShardedTensor needs a collective to
    build and placement strings per rank. The protocol needs neither: DCP's
    default planners then write each chunk once (identical chunks of replicas
    are deduplicated by offset) and read, on load, exactly the overlap of the
    saved chunks with this rank's chunks: that is the resharding.

    ZeRO: ``t`` holds only ``rows`` (default: its own tag) of the tensor-parallel shard
    (a DTensor: its local rows); the chunks are cut to those rows. None when this rank
    owns no rows of it (nothing to write or read).
    """
    rows = rows if rows is not None else get_zero_rows(t)
    t = local(t)
    if rows is None or t.dim() == 0:
        dense, chunks = shard_chunks(tuple(t.shape), spec, ctx)
    else:
        dense, chunks = shard_chunks((rows.rows, *t.shape[1:]), spec, ctx)
        chunks = _rows_only(chunks, rows, t.shape[0])
        if not chunks:
            return None
    view = t.detach()
    view.global_shape = dense
    view.global_offsets = tuple(c[0] for c in chunks)
    view.local_offsets = tuple(c[1] for c in chunks)
    view.local_sizes = tuple(c[2] for c in chunks)
    return view


# ---- layout and RNG ----------------------------------------------------------------------------
def layout(ctx: ParallelContext) -> dict[str, Any]:
    """The rank grid a checkpoint was written under (RNG states only fit the same grid)."""
    return {
        "world_size": ctx.world_size(ParallelMode.GLOBAL),
        "data": ctx.data_parallel_size,
        "pipeline": ctx.pipeline_parallel_size,
        "tensor": ctx.tensor_parallel_size,
        "tensor_mode": ctx.tensor_mode,
        "parallel": repr(getattr(ctx.config, "parallel", None)),
    }


def rng_state(ctx: ParallelContext) -> dict[str, Any]:
    """Every generator this rank draws from: python, numpy, torch (CPU and this GPU), and the
    context's per-mode states (dropout inside tensor-parallel regions)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "modes": ctx.rng.state_dict(),
    }
    if ctx.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return state


def set_rng_state(ctx: ParallelContext, state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if ctx.device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], ctx.device)
    ctx.rng.load_state_dict(state["modes"])
