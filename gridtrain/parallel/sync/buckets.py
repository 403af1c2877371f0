"""Gradient buckets: the gradients of parameters that share a data-parallel group, flattened.

One builder (``group_buckets``) serves every bucketed path: the all-reduce buckets here
(the data-parallel handlers after backward, the overlapped path during it) and ZeRO 1-2's
reduce-scatter buckets (``zero/row_buckets.py``). Members are taken in reverse
registration order (roughly the order backward produces their gradients) and grouped by a
key (group, dtype, device, ...) up to a byte cap, like torch DDP's buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

DEFAULT_BUCKET_MB = 25.0
T = TypeVar("T")


def group_buckets(
    members: Iterable[T],
    key: Callable[[T], Hashable],
    nbytes: Callable[[T], int],
    bucket_size_mb: float,
) -> list[tuple[Hashable, list[T]]]:
    """``(key, members)`` per bucket: ``members`` in reverse order, grouped by ``key`` until
    a group reaches ``bucket_size_mb``; full buckets in the order they filled, then the
    partial ones in the order their keys first appeared.

    The order depends only on the order of ``members``, so every rank of a group that
    lists the model's parameters alike builds the same buckets and issues their
    collectives in the same order.
    """
    cap = bucket_size_mb * 2**20
    open_: dict[Hashable, tuple[list[T], int]] = {}
    out: list[tuple[Hashable, list[T]]] = []
    for m in reversed(list(members)):
        k = key(m)
        group, size = open_.get(k, ([], 0))
        group.append(m)
        size += nbytes(m)
        if size >= cap:
            out.append((k, group))
            group, size = [], 0
        open_[k] = (group, size)
    out.extend((k, group) for k, (group, _) in open_.items() if group)
    return out


def param_bytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


class FlatBucket:
    """A bucket's collective: the flat ``buffer`` it runs on and the ``work`` in flight."""

    buffer: Tensor | None = None
    work = None
    probe = staticmethod(lambda: None)  # engine.memory()'s sample point: buffers at their largest

    def wait(self) -> None:
        """Wait for the collective that ``launch`` started (``finish`` begins with it)."""
        if self.buffer is None:
            raise RuntimeError(f"{type(self).__name__}.finish() called before launch()")
        if self.work is not None:
            self.work.wait()


class Bucket(FlatBucket):
    """Parameters whose gradients are averaged together over one process group."""

    def __init__(self, mode: ParallelMode, params: list[Tensor], ctx: ParallelContext):
        self.mode = mode
        self.params = params
        self.group = ctx.group(mode)
        self.world = ctx.world_size(mode)

    @torch.no_grad()
    def launch(self, async_op: bool) -> None:
        """Copy the gradients into one flat buffer (pre-divided by the group size) and reduce it."""
        flat = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params
        ]
        # dividing first keeps fp16 sums in range; the sum of the quotients is the mean
        self.buffer = torch.cat(flat).div_(self.world)
        self.probe()
        if async_op:
            self.work = comm.all_reduce_async(self.buffer, self.group)
        else:
            comm.all_reduce_(self.buffer, self.group)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the reduction and write the averaged gradients back into ``.grad``."""
        self.wait()
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
    """All-reduce buckets for the trainable ``params`` whose group (``mode_of(p)``) has more
    than one rank."""
    if bucket_size_mb <= 0:
        raise ValueError(f"gradient handler kwarg bucket_size_mb must be > 0, got {bucket_size_mb}")
    # a parameter listed twice counts once, where backward reaches it first
    last_use = {id(p): p for p in reversed(list(params)) if p.requires_grad}
    synced = [p for p in reversed(last_use.values()) if ctx.world_size(mode_of(p)) > 1]
    key = lambda p: (mode_of(p), p.dtype, p.device)  # noqa: E731
    grouped = group_buckets(synced, key, param_bytes, bucket_size_mb)
    return [Bucket(k[0], members, ctx) for k, members in grouped]


def all_reduce_buckets(buckets: list[Bucket]) -> None:
    """Average every bucket: all reductions in flight at once, then write back."""
    for b in buckets:
        b.launch(async_op=True)
    for b in buckets:
        b.finish()
