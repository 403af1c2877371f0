"""Data loading for data parallelism: each data-parallel rank reads its own shard of the dataset.

Tensor- and pipeline-parallel ranks of one model replica share a data-parallel
rank and therefore read the same batches; the engine then splits each batch
the way the tensor mode needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.mode import ParallelMode


def get_dataloader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 1024,
    drop_last: bool = False,
    ctx: ParallelContext | None = None,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader giving this data-parallel rank ``batch_size`` samples per batch.

    A ``DistributedSampler`` over the DATA group (``num_replicas`` = data size,
    ``rank`` = data rank) hands each data rank a distinct shard; with
    ``shuffle`` the order depends only on ``seed`` and the epoch, so call
    ``loader.sampler.set_epoch(epoch)`` at the start of every epoch. Other
    ``kwargs`` go to ``torch.utils.data.DataLoader`` (``num_workers``,
    ``pin_memory``, ``collate_fn``, ...). Without a launched context the loader
    reads the whole dataset.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"get_dataloader: batch_size must be a positive int, got {batch_size!r}")
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ValueError("get_dataloader builds its own DistributedSampler; do not pass sampler=")
    if ctx is None and has_context():
        ctx = get_context()
    replicas = ctx.world_size(ParallelMode.DATA) if ctx is not None else 1
    rank = ctx.local_rank(ParallelMode.DATA) if ctx is not None else 0
    sampler = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    if kwargs.get("num_workers", 0) > 0 and "generator" not in kwargs:
        # worker RNG seeds derive from this generator: same seed, same augmentations every run
        kwargs["generator"] = torch.Generator().manual_seed(seed + rank)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs
    )
