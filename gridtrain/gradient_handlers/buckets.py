"""Gradient buckets: flatten the gradients of parameters that share a data-parallel group.

Shared by ``DataParallelGradientHandler`` (all-reduce after backward) and the
engine's overlapped path (all-reduce launched from gradient hooks during
backward). A bucket holds parameters of one group, dtype and device, in reverse
registration order (roughly the order backward produces their gradients), up
to a byte cap, like torch DDP's buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

DEFAULT_BUCKET_MB = 25.0


class Bucket:
    """Parameters whose gradients are averaged together over one process group."""

    def __init__(self, mode: ParallelMode, params: list[Tensor], ctx: ParallelContext):
        self.mode = mode
        self.params = params
        self.group = ctx.group(mode)
        self.world = ctx.world_size(mode)
        self.buffer: Tensor | None = None
        self.work = None

    @torch.no_grad()
    def launch(self, async_op: bool) -> None:
        """Copy the gradients into one flat buffer (pre-divided by the group size) and reduce it."""
        flat = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params
        ]
        # dividing first keeps fp16 sums in range; the sum of the quotients is the mean
        self.buffer = torch.cat(flat).div_(self.world)
        if async_op:
            self.work = comm.all_reduce_async(self.buffer, self.group)
        else:
            comm.all_reduce_(self.buffer, self.group)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the reduction and write the averaged gradients back into ``.grad``."""
        if self.buffer is None:
            raise RuntimeError("Bucket.finish() called before launch()")
        if self.work is not None:
            self.work.wait()
        offset = 0
        for p in self.params:
            mean = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is not None:
                p.grad.copy_(mean)
            elif mean.any():  # unused here but not on another replica
                p.grad = mean.clone()
        self.buffer, self.work = None, None


def build_buckets(
    params: Iterable[Tensor],
    ctx: ParallelContext,
    mode_of: Callable[[Tensor], ParallelMode],
    bucket_size_mb: float = DEFAULT_BUCKET_MB,
) -> list[Bucket]:
    """Buckets for the trainable ``params`` whose group (``mode_of(p)``) has more than one rank.

    The order depends only on the model's parameter order, so every rank of a
    group builds the same buckets and issues their collectives in the same order.
    """
    if bucket_size_mb <= 0:
        raise ValueError(f"gradient handler kwarg bucket_size_mb must be > 0, got {bucket_size_mb}")
    cap = bucket_size_mb * 2**20
    seen: set[int] = set()
    open_: dict[tuple, tuple[list[Tensor], int]] = {}
    buckets: list[Bucket] = []
    for p in reversed(list(params)):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        mode = mode_of(p)
        if ctx.world_size(mode) == 1:
            continue
        key = (mode, p.dtype, p.device)
        members, size = open_.get(key, ([], 0))
        members.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(Bucket(mode, members, ctx))
            members, size = [], 0
        open_[key] = (members, size)
    buckets.extend(Bucket(k[0], m, ctx) for k, (m, _) in open_.items() if m)
    return buckets


def all_reduce_buckets(buckets: list[Bucket]) -> None:
    """Average every bucket: all reductions in flight at once, then write back."""
    for b in buckets:
        b.launch(async_op=True)
    for b in buckets:
        b.finish()
