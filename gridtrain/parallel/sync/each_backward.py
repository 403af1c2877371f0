"""Gradient sync in every backward: ZeRO 2's reduce-scatter as each bucket fills, micro-step
after micro-step (what DeepSpeed's stage 2 does), so a rank never holds more than its rows
plus the buckets in flight, under gradient accumulation and every pipeline schedule.

Every trainable parameter of the buckets gets a post-accumulate-grad hook. Within one
backward (one accumulation micro-step, or one pipeline micro-batch through one chunk) a
bucket launches when the last of its gradients has been accumulated, strictly in bucket
order, and drops those gradients once they are in its send buffer; at most
``max_in_flight`` buckets run at once (the oldest is finished, its rows added into the
row accumulators, before another starts). The end of the backward (a callback its first
hook queues on the autograd engine) launches the buckets no hook launched (a parameter
unused this time contributes zeros, as a parameter unused on one replica does in the
overlapped all-reduce) and finishes every bucket: between backwards no gradient is held
but the accumulators.

Buckets belong to one pipeline chunk (``pipeline_chunks``): an interleaved stage's backward
reaches one of its chunks, and only that chunk's buckets are launched at its end. Every
rank of a data-parallel group runs the same schedule, so its backwards reach the same
chunks and launch the same buckets in the same order. A ``deferred`` bucket (tied pipeline
weights, whose handler sums the full gradients first; or a parameter of several chunks)
is launched only by ``finish()``, before the optimizer step.
"""

from __future__ import annotations

from collections import deque

from torch import Tensor, nn
from torch.autograd import Variable

from gridtrain.parallel.sync.base import GradSync


def pipeline_chunks(model: nn.Module) -> dict[int, int]:
    """``id(param) -> chunk`` for a pipeline stage holding several chunks (its
    ``chunk_layer_names``), -1 for a parameter of several chunks; {} for any other model
    (one chunk, 0)."""
    names = getattr(model, "chunk_layer_names", None)
    if not names or len(names) < 2:
        return {}
    out: dict[int, int] = {}
    for chunk, layers in enumerate(names):
        for name in layers:
            for p in model.get_submodule(name).parameters():
                out[id(p)] = chunk if out.get(id(p), chunk) == chunk else -1
    return out


class EachBackward(GradSync):
    """Reduces ``buckets`` (objects with ``params``, ``pipeline_chunk``, ``deferred``,
    ``launch(async_op)`` and ``finish()``, which adds the result into the accumulators) in
    every backward; see the module docstring."""

    def __init__(self, buckets: list, max_in_flight: int = 2):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.buckets, self.max_in_flight = buckets, max_in_flight
        self._order: dict[int, list[int]] = {}  # chunk -> its hook-launched buckets, in order
        for i, b in enumerate(buckets):
            if not b.deferred:
                self._order.setdefault(b.pipeline_chunk, []).append(i)
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for b in buckets for p in b.params
        ]
        self._in_flight: deque = deque()
        self._reset()

    def _reset(self) -> None:
        self._fired: list[set[int]] = [set() for _ in self.buckets]
        self._next = dict.fromkeys(self._order, 0)  # per chunk: first bucket not launched
        self._touched: set[int] = set()  # chunks this backward reached
        self._queued = False

    def _on_grad(self, param: Tensor) -> None:
        if not self._queued:
            Variable._execution_engine.queue_callback(self._end_backward)
            self._queued = True
        index = self._bucket_of[id(param)]
        bucket = self.buckets[index]
        if bucket.deferred:
            return
        self._touched.add(bucket.pipeline_chunk)
        self._fired[index].add(id(param))
        self._launch_ready(bucket.pipeline_chunk, until_end=False)

    def _launch_ready(self, chunk: int, until_end: bool) -> None:
        """Launch ``chunk``'s buckets in order while they are complete (all: ``until_end``)."""
        order = self._order[chunk]
        while self._next[chunk] < len(order):
            index = order[self._next[chunk]]
            if not until_end and len(self._fired[index]) < len(self.buckets[index].params):
                return
            self._launch(self.buckets[index])
            self._next[chunk] += 1

    def _launch(self, bucket) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().finish()
        bucket.launch(async_op=True)
        self._in_flight.append(bucket)

    def _drain(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().finish()

    def _end_backward(self) -> None:
        for chunk in sorted(self._touched):
            self._launch_ready(chunk, until_end=True)
        self._drain()
        self._reset()

    def finish(self) -> None:
        """Reduce the deferred buckets (their handler has summed them by now) and wait."""
        for bucket in self.buckets:
            if bucket.deferred:
                self._launch(bucket)
        self._drain()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
