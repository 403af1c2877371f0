"""Data loading for data parallelism: each data-parallel rank reads its own shard of the dataset.

Tensor- and pipeline-parallel ranks of one model replica share a data-parallel
rank and therefore read the same batches; the engine then splits each batch
the way the tensor mode needs.

Every loader has a generator of its own, seeded from ``seed``, the data rank and the
sampler's epoch each time an iterator starts. torch's DataLoader otherwise draws each new
iterator's worker seed from the global RNG (with ``num_workers=0`` too), so a resume that
fast-forwards through batches would shift the dropout masks that follow it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gridtrain.children import WorkerInit
from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.registry import split_batch


class SeededLoader(DataLoader):
    """A DataLoader whose generator restarts at every iterator from (seed, data rank, the
    sampler's epoch): the workers' seeds (augmentations) depend on nothing else, and no
    iterator draws from the global RNG."""

    def __init__(self, *args: Any, seed: int, rank: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seed, self.rank = seed, rank

    def __iter__(self):
        epoch = getattr(self.sampler, "epoch", 0)
        self.generator.manual_seed((self.seed + self.rank + (epoch << 32)) % 2**63)
        return super().__iter__()


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
    reads the whole dataset. The loader's own generator (a ``generator=`` given is
    reseeded the same way) keeps iterators off the global RNG, so a resumed run draws
    the dropout masks of an uninterrupted one. A batch the tensor mode cannot split
    (2d/2.5d/3d cut the batch into blocks: ``drop_last=False`` with a last batch of the
    wrong size) is refused here, naming the sizes, not at the epoch's last step.
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
    if ctx is not None:
        _check_splits(len(sampler), batch_size, drop_last, ctx)
    kwargs.setdefault("generator", torch.Generator())
    if kwargs.get("num_workers", 0):  # its workers die with this process (gridtrain.children)
        kwargs["worker_init_fn"] = WorkerInit(kwargs.get("worker_init_fn"))
    return SeededLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        seed=seed,
        rank=rank,
        **kwargs,
    )


def _check_splits(samples: int, batch_size: int, drop_last: bool, ctx: ParallelContext) -> None:
    """Every batch this rank will see (full ones, and the last one unless dropped) splits
    under the tensor mode: probed through the engine's own ``split_batch``."""
    if ctx.tensor_mode is None:
        return
    sizes = {batch_size} if samples >= batch_size else set()
    last = samples % batch_size
    if last and not drop_last:
        sizes.add(last)
    tensor = ctx.world_size(ParallelMode.TENSOR)
    for size in sorted(sizes, reverse=True):
        try:  # [batch, tensor size]: a sequence split of dim 1 divides too
            split_batch(torch.empty(size, tensor), ctx)
        except ValueError as err:
            which = "each batch" if size == batch_size else "the last batch of each epoch"
            hint = (
                "pass drop_last=True, or a batch_size that leaves a last batch it splits"
                if size != batch_size
                else "choose a batch_size it splits"
            )
            raise ValueError(
                f"get_dataloader: {which} holds {size} samples ({samples} per data rank in "
                f"batches of {batch_size}), which tensor mode {ctx.tensor_mode!r} cannot "
                f"split: {err}; {hint}"
            ) from None
