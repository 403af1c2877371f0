"""What save_pretrained and load_pretrained share: the dense view of a (sharded, pipelined)
model's tensors, the slices a rank holds, and agreeing on errors across ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.dense_state import dense_dtype
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sharding import cut, dense_items, dense_shape, unwrap
from gridtrain.parallel.tags import get_shard_spec, is_pipeline_shared, pipeline_tie

# safetensors' dtype names (the header of a .safetensors file)
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class Entry:
    """One dense tensor of the model as this rank holds it."""

    key: str
    tensor: Tensor  # this rank's part: a tensor-parallel shard, ZeRO rows, a DTensor
    shape: tuple[int, ...]  # dense shape
    dtype: torch.dtype  # dense dtype: the master's where the optimizer steps an fp32 copy
    tie: int | None  # pipeline tie index (the same dense tensor on the first and last stage)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def current(ctx: ParallelContext | None) -> ParallelContext | None:
    if ctx is not None:
        return ctx
    return get_context() if has_context() else None


def entries(model: nn.Module, ctx: ParallelContext | None) -> tuple[list[Entry], dict[str, str]]:
    """(this rank's tensors under their dense keys, once each; alias key -> kept key).

    A weight tied inside the model (GPT-2's ``lm_head.weight`` is ``wte.weight``) is kept
    under its first key, as ``transformers`` saves it; the alias maps the other key to it.
    """
    out, aliases, seen = [], {}, {}
    for key, t in dense_items(model):
        if id(t) in seen:
            aliases[key] = seen[id(t)]
            continue
        seen[id(t)] = key
        shape = dense_shape(t, ctx) if ctx is not None else tuple(t.shape)
        tie = pipeline_tie(t) if is_pipeline_shared(t) else None
        out.append(Entry(key, t, tuple(shape), dense_dtype(t), tie))
    return out, aliases


def hf_config(model: nn.Module):
    """The Hugging Face config of ``model`` (or of the model a pipeline stage was cut from)."""
    cfg = getattr(unwrap(model), "config", None)
    if cfg is None or not hasattr(cfg, "save_pretrained"):
        raise TypeError(
            f"{type(model).__name__} carries no Hugging Face config: gridtrain.hf takes a "
            "transformers model (or the engine.model it became)"
        )
    return cfg


def index_runs(
    length: int, splits: list[tuple[int, int, int]], rows: tuple[int, int] | None = None
) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of the dense indices a rank holds along one dim.

    ``splits``: ``(n, rank, parts)`` cuts applied in order, as ``sharding.shard_tensor``
    cuts (packed blocks give one run per block); ``rows``: then only positions
    ``[lo, hi)`` of what the cuts keep (a rank's ZeRO rows of its shard).
    """
    idx = torch.arange(length)
    for n, rank, parts in splits:
        idx = cut(idx, 0, n, rank, parts)
    if rows is not None:
        idx = idx[rows[0] : rows[1]]
    runs: list[tuple[int, int]] = []
    for i in idx.tolist():
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def local_runs(
    e: Entry, ctx: ParallelContext | None, rows: tuple[int, int] | None = None
) -> list[list[tuple[int, int]]]:
    """Per dim of ``e``'s dense tensor, the runs this rank holds: of its tensor-parallel
    shard, or only the shard's ``rows`` (``[lo, hi)`` of dim 0)."""
    per_dim: list[list[tuple[int, int, int]]] = [[] for _ in e.shape]
    for dim, mode, parts in get_shard_spec(e.tensor) if ctx is not None else ():
        per_dim[dim].append((ctx.world_size(mode), ctx.local_rank(mode), parts))
    return [
        index_runs(size, cuts, rows if dim == 0 else None)
        for dim, (size, cuts) in enumerate(zip(e.shape, per_dim, strict=True))
    ]


def world(ctx: ParallelContext | None) -> int:
    if ctx is None or not dist.is_initialized():
        return 1
    return ctx.world_size(ParallelMode.GLOBAL)


def gather_objects(obj: Any, ctx: ParallelContext | None, mode: ParallelMode) -> list[Any]:
    """``obj`` of every rank of ``mode``'s group (just ``[obj]`` without processes)."""
    if world(ctx) == 1 or ctx.world_size(mode) == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size(mode)
    dist.all_gather_object(out, obj, group=ctx.group(mode))
    return out


def agree_on_error(error: str | None, ctx: ParallelContext | None, exc=ValueError) -> None:
    """Raise on every rank if any rank found an error (the lowest rank's message)."""
    errors = gather_objects(error, ctx, ParallelMode.GLOBAL)
    for rank, message in enumerate(errors):
        if message is not None:
            where = "" if len(errors) == 1 else f" (rank {rank})"
            raise exc(f"{message}{where}")
