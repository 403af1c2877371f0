"""Overlapped data-parallel gradient sync: all-reduce buckets while backward is still running.

Like torch DDP's reducer: every trainable parameter gets a post-accumulate-grad
hook; when the last gradient of a bucket has been accumulated the bucket's
async all-reduce starts, and ``finish()`` (called by the engine before the
optimizer step) waits for them. Buckets launch strictly in bucket order, so
every rank of a group issues the same collectives in the same order even when
a parameter gets no gradient on some rank.

Hooks only launch inside ``around_backward(last=True)``, which the engine enters around
the last backward of an accumulation window (and a pipeline schedule around its last
micro-batch's backward); any bucket not launched by then is reduced in ``finish()``. So
accumulation, pipeline micro-batches and fp16 loss scaling all stay correct whether or
not the overlap happens.

ZeRO stages 1-2 drive the same path with their own buckets (``buckets=``: any objects
with ``params``, ``launch(async_op)`` and ``finish()``; theirs reduce-scatter). A bucket
marked ``deferred`` (tied pipeline weights, whose handler must sum first) is never
launched from a hook, only by ``finish()``; such buckets come last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sync.base import GradSync
from gridtrain.parallel.sync.buckets import DEFAULT_BUCKET_MB, build_buckets
from gridtrain.parallel.tags import get_dp_mode


class OverlappedDataParallel(GradSync):
    """Averages each gradient over ``get_dp_mode(param)``, overlapping backward."""

    def __init__(
        self,
        model: nn.Module,
        ctx: ParallelContext,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        buckets: list | None = None,
    ):
        if buckets is None:
            buckets = build_buckets(
                model.parameters(), ctx, lambda p: get_dp_mode(p, ctx), bucket_size_mb
            )
        self.buckets = buckets
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for p in b.params
        ]
        self._active = False
        self._reset()

    def _reset(self) -> None:
        self._fired: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0  # first bucket not launched yet

    @property
    def enabled(self) -> bool:
        """Whether any parameter has a data-parallel group of more than one rank."""
        return bool(self.buckets)

    @contextlib.contextmanager
    def overlap(self) -> Iterator[None]:
        """Backward inside launches each bucket's all-reduce as soon as its gradients are final."""
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def around_backward(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """The window's last backward overlaps the all-reduce; earlier ones accumulate."""
        return self.overlap() if last else contextlib.nullcontext()

    def _on_grad(self, param: Tensor) -> None:
        if not self._active:
            return
        index = self._bucket_of[id(param)]
        if index < self._next or id(param) in self._fired[index]:
            raise RuntimeError(
                "a gradient was accumulated again after its data-parallel all-reduce was "
                "scheduled; only the last backward before engine.step() may run inside "
                "engine.overlap_grad_sync()"
            )
        fired = self._fired[index]
        fired.add(id(param))
        if len(fired) == len(self.buckets[index].params):
            while (
                self._next < len(self.buckets)
                and len(self._fired[self._next]) == len(self.buckets[self._next].params)
                and not getattr(self.buckets[self._next], "deferred", False)
            ):
                self.buckets[self._next].launch(async_op=True)
                self._next += 1

    def finish(self) -> None:
        """Launch what backward did not, wait for every bucket, write the averaged gradients."""
        for bucket in self.buckets[self._next :]:
            bucket.launch(async_op=True)
        self.probe()  # every bucket's buffer is held now
        for bucket in self.buckets:
            bucket.finish()
        self._reset()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
