"""ZeRO 1-2's buckets: the rows of parameters of one group and dtype, in one collective.

A ``RowShard`` pairs a model parameter with the optimizer's parameter holding this rank's
rows of it (``parallel/rows.py``). A ``RowBucket`` lays the gradients of its shards out rank by rank
and reduce-scatters them (``launch``/``finish``, driven during backward: by the overlapped
data-parallel path in the window's last backward at stage 1, ``parallel.sync.data_parallel``,
and in every backward at stage 2, ``parallel.sync.each_backward``), adding each rank's rows
into the masters' gradients (the row accumulators), and all-gathers the updated rows
after the step (``launch_gather``/``finish_gather``). Gemini's chunks (``offload_chunk``)
lay their rows out the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gridtrain.parallel.comm import all_gather_single, reduce_scatter_single
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import as_rows, chunk_rows, owned_range
from gridtrain.parallel.sync.buckets import FlatBucket, group_buckets, param_bytes
from gridtrain.parallel.tags import is_pipeline_shared


class RowShard:
    """A model parameter and the optimizer's parameter holding this rank's rows of it."""

    def __init__(
        self, param: Tensor, master: Tensor, mode: ParallelMode, n: int, rank: int, is_view: bool
    ):
        self.param, self.master, self.mode, self.is_view = param, master, mode, is_view
        self.rows = as_rows(param).shape[0]
        self.row_numel = param.numel() // self.rows
        self.chunk = chunk_rows(self.rows, n)
        self.lo, self.hi = owned_range(self.rows, n, rank)

    @property
    def padded(self) -> int:
        """Elements of one rank's chunk in a bucket segment."""
        return self.chunk * self.row_numel

    def owned_state(self, state: dict, device: torch.device) -> dict:
        """Optimizer state of the parameter loaded before ``initialize``: each moment (shaped
        as the parameter) cut to this rank's rows, on ``device``; scalars as they are."""
        shape = self.param.shape
        return {
            k: v[self.lo : self.hi].clone().to(device)
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape == shape
            else v
            for k, v in state.items()
        }

    def chunks(self, flat: Tensor, n: int) -> Tensor:
        """``flat`` ([n, segment] slice of this shard) as [n, chunk, row]."""
        return flat.view(n, self.chunk, self.row_numel)


def rows_to_chunks(src: Tensor, dst: Tensor, s: RowShard) -> None:
    """Copy the rows of ``src`` (shape [rows, row]) into ``dst`` [n, chunk, row], chunk by chunk."""
    full, rem = divmod(s.rows, s.chunk) if s.chunk else (0, 0)
    if full:
        dst[:full].copy_(src[: full * s.chunk].view(full, s.chunk, s.row_numel))
    if rem:
        dst[full, :rem].copy_(src[full * s.chunk :])


def chunks_to_rows(src: Tensor, dst: Tensor, s: RowShard) -> None:
    """The inverse: rows of ``src`` [n, chunk, row] into ``dst`` [rows, row]."""
    full, rem = divmod(s.rows, s.chunk) if s.chunk else (0, 0)
    if full:
        dst[: full * s.chunk].view(full, s.chunk, s.row_numel).copy_(src[:full])
    if rem:
        dst[full * s.chunk :].copy_(src[full, :rem])


class RowBucket(FlatBucket):
    """Shards of one data-parallel group and dtype whose rows travel in one collective.

    One rank's segment holds, per shard, a chunk of ``chunk`` rows (zero-padded); the
    flat buffer of a reduce-scatter or all-gather is ``n`` segments, rank by rank.
    ``launch``/``finish`` is the gradient reduce-scatter (the overlapped data-parallel
    path drives them), ``launch_gather``/``finish_gather`` the parameter all-gather.
    """

    def __init__(
        self,
        shards: list[RowShard],
        mode: ParallelMode,
        ctx: ParallelContext,
        free_grads: bool,
        pipeline_chunk: int = 0,
    ):
        self.shards, self.mode, self.pipeline_chunk = shards, mode, pipeline_chunk
        self.group, self.n = ctx.group(mode), ctx.world_size(mode)
        self.free_grads = free_grads
        self.deferred = any(is_pipeline_shared(s.param) for s in shards)  # handler runs first
        self.offsets, self.segment = [], 0
        for s in shards:
            self.offsets.append(self.segment)
            self.segment += s.padded

    @property
    def params(self) -> list[Tensor]:
        return [s.param for s in self.shards]

    def _collective(self, fn, out: Tensor, inp: Tensor, async_op: bool):
        return fn(out, inp, group=self.group, async_op=async_op)

    # ---- gradients: reduce-scatter ------------------------------------------------------
    @torch.no_grad()
    def launch(self, async_op: bool = True) -> None:
        """Lay every gradient out rank by rank (pre-divided by ``n``) and reduce-scatter it."""
        if self.n == 1:  # a group of one: the masters take the gradients as they are
            self.buffer = self._send = torch.empty(0)
            return
        first = self.shards[0].param
        grad_dtype = first.grad.dtype if first.grad is not None else first.dtype
        send = torch.zeros(self.n * self.segment, dtype=grad_dtype, device=first.device)
        self.buffer = send  # held from here: counted by a probe
        self.probe()
        rank_major = send.view(self.n, self.segment)
        for s, off in zip(self.shards, self.offsets):
            g = s.param.grad
            if g is not None:
                dst = s.chunks(rank_major[:, off : off + s.padded], self.n)
                rows_to_chunks(g.reshape(s.rows, s.row_numel), dst, s)
                if self.free_grads:
                    s.param.grad = None
        send.div_(self.n)  # the sum of the quotients is the mean; keeps fp16 sums in range
        self.buffer = send.new_empty(self.segment)
        self.work = self._collective(reduce_scatter_single, self.buffer, send, async_op)
        self._send = send

    @torch.no_grad()
    def finish(self) -> None:
        """Wait; each master's gradient (its row accumulator) takes its rows of the mean: the
        first of a window becomes it (a view when dtypes agree), later ones are added."""
        self.wait()
        for s, off in zip(self.shards, self.offsets):
            if self.n == 1:
                g = s.param.grad
                if self.free_grads:
                    s.param.grad = None
                if g is None:
                    continue
                g = g.view(s.master.shape)
            else:
                g = self.buffer[off : off + (s.hi - s.lo) * s.row_numel].view(s.master.shape)
            g = g.to(device=s.master.device, dtype=s.master.dtype)
            if s.master.grad is None:
                s.master.grad = g
            else:
                s.master.grad.add_(g)
        self.buffer, self.work, self._send = None, None, None

    # ---- parameters: all-gather ---------------------------------------------------------
    @torch.no_grad()
    def launch_gather(self) -> None:
        if self.n == 1:  # a group of one: only copied masters need writing back
            for s in self.shards:
                if not s.is_view:
                    s.param.data.copy_(s.master.view(s.param.shape))
            return
        first = self.shards[0].param
        send = torch.zeros(self.segment, dtype=first.dtype, device=first.device)
        for s, off in zip(self.shards, self.offsets):
            owned = (s.hi - s.lo) * s.row_numel
            send[off : off + owned].copy_(s.master.reshape(-1))
        self._gathered = send.new_empty(self.n * self.segment)
        self._gather_send = send
        self._gather_work = self._collective(all_gather_single, self._gathered, send, True)

    @torch.no_grad()
    def finish_gather(self) -> None:
        if self.n == 1:
            return
        if self._gather_work is not None:
            self._gather_work.wait()
        rank_major = self._gathered.view(self.n, self.segment)
        for s, off in zip(self.shards, self.offsets):
            src = s.chunks(rank_major[:, off : off + s.padded], self.n)
            chunks_to_rows(src, as_rows(s.param.data).view(s.rows, s.row_numel), s)
        self._gathered = self._gather_work = self._gather_send = None


def build_row_buckets(
    shards: list[RowShard],
    ctx: ParallelContext,
    free_grads: bool,
    bucket_size_mb: float,
    chunk_of: dict[int, int] | None = None,
) -> list[RowBucket]:
    """Buckets in reverse parameter order (backward's order), tied pipeline weights last
    (``deferred``: their handler sums the full gradients before they are reduce-scattered).

    ``chunk_of`` (``parallel.sync.each_backward.pipeline_chunks``): a parameter's pipeline
    chunk, so a bucket holds one chunk's parameters (-1: several chunks; such a bucket is
    deferred too, since no one backward completes it)."""
    chunk_of = chunk_of or {}

    def key(s: RowShard) -> tuple:
        chunk = chunk_of.get(id(s.param), 0)
        return (s.mode, s.param.dtype, s.param.device, is_pipeline_shared(s.param), chunk)

    grouped = group_buckets(shards, key, lambda s: param_bytes(s.param), bucket_size_mb)
    grouped.sort(key=lambda kb: kb[0][3] or kb[0][4] < 0)  # stable: deferred buckets last
    out = []
    for k, members in grouped:
        bucket = RowBucket(members, k[0], ctx, free_grads, pipeline_chunk=k[4])
        bucket.deferred = bucket.deferred or k[4] < 0
        out.append(bucket)
    return out
