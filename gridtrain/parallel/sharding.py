"""Dense twins: how each parameter's shard maps into the dense (layout-free) tensor.

A parallel layer tags each sharded parameter with a *shard spec*
(``tags.Split``s applied in order): the dense tensor is cut into
``world_size(mode)`` equal chunks along ``dim`` and this rank keeps chunk
``local_rank(mode)``; the next split cuts that chunk again. A split with
``parts > 1`` first views ``dim`` as that many packed blocks (fused q/k/v) and
keeps the rank's chunk of each. An untagged tensor is replicated. From the
specs alone, ``full_tensor`` rebuilds dense tensors (all-gathers in reverse
order) and ``shard_tensor`` cuts them again; ``dense_state`` builds the model's
full state dict from them, so checkpoints move between any layouts and the
model built with no parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import get_zero_rows
from gridtrain.parallel.tags import ShardSpec, as_spec, get_shard_spec


def _check(full: Tensor, dim: int, n: int, parts: int, mode: ParallelMode) -> None:
    if full.shape[dim] % (n * parts):
        what = f"{parts} packed blocks each" if parts > 1 else "it"
        raise ValueError(
            f"dense dim {dim} of size {full.shape[dim]} does not split {n} ways over "
            f"{mode.name} ({what})"
        )


def cut(full: Tensor, dim: int, n: int, index: int, parts: int = 1) -> Tensor:
    """Chunk ``index`` of ``n`` along ``dim`` (of each of ``parts`` packed blocks); a view."""
    if parts == 1:
        return full.chunk(n, dim=dim)[index]
    dim = dim % full.dim()
    blocks = full.unflatten(dim, (parts, full.shape[dim] // parts))
    return blocks.chunk(n, dim=dim + 1)[index].flatten(dim, dim + 1)


def shard_tensor(full: Tensor, spec, ctx: ParallelContext) -> Tensor:
    """This rank's shard of the dense tensor ``full`` (a new contiguous tensor)."""
    for dim, mode, parts in as_spec(spec):
        n = ctx.world_size(mode)
        _check(full, dim, n, parts, mode)
        full = cut(full, dim, n, ctx.local_rank(mode), parts)
    return full.clone(memory_format=torch.contiguous_format)


def shard_shape(dense_shape, spec, ctx: ParallelContext) -> tuple[int, ...]:
    """The shape of this rank's shard of a dense tensor of ``dense_shape``."""
    shape = list(dense_shape)
    for dim, mode, parts in as_spec(spec):
        n = ctx.world_size(mode)
        if shape[dim] % (n * parts):
            raise ValueError(
                f"dense dim {dim} of size {shape[dim]} does not split {n} ways over {mode.name}"
            )
        shape[dim] //= n
    return tuple(shape)


def dense_shape(shard: Tensor, ctx: ParallelContext, spec: ShardSpec | None = None) -> tuple:
    """The dense shape of ``shard`` (its own spec unless ``spec`` is given). A tensor holding
    only this rank's ZeRO rows (``parallel.rows``) counts as its whole shard; a DTensor's
    shape is that already."""
    shape = list(shard.shape)
    rows = get_zero_rows(shard)
    if rows is not None and not isinstance(shard, DTensor) and shape:
        shape[0] = rows.rows
    for dim, mode, _ in get_shard_spec(shard) if spec is None else as_spec(spec):
        shape[dim] *= ctx.world_size(mode)
    return tuple(shape)


def full_tensor(shard: Tensor, spec, ctx: ParallelContext) -> Tensor:
    """The dense tensor, rebuilt from every rank's shard (collective over the spec's groups)."""
    for dim, mode, parts in reversed(as_spec(spec)):
        group = ctx.group(mode)
        if parts == 1:
            shard = comm.all_gather_raw(shard.detach(), dim, group)
            continue
        dim = dim % shard.dim()
        blocks = shard.detach().unflatten(dim, (parts, shard.shape[dim] // parts))
        shard = comm.all_gather_raw(blocks.contiguous(), dim + 1, group).flatten(dim, dim + 1)
    return shard


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside engine wrappers (DDP, fp16 wrappers) that expose ``.module``."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or getattr(
        model, "gt_wrapper", False
    ):
        model = model.module
    return model


def dense_items(model: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """(dense key, local tensor) pairs; a model may rename keys via ``dense_key(name)``."""
    model = unwrap(model)
    rename = getattr(model, "dense_key", None)
    for name, t in model.state_dict(keep_vars=True).items():
        yield (rename(name) if rename else name), t
