"""ZeRO stages 1 and 2: the optimizer steps only this rank's rows of every parameter.

At ``gt.initialize`` the user's optimizer is rebound (``rebind_optimizer``) from each
parameter to a new parameter holding the rows this rank owns (``partition``): a view of
the model's rows when the model trains in its own dtype, an fp32 copy (the master
weight) under naive fp16 or with ``offload`` (then in CPU memory). So optimizer state
and masters exist once across the data-parallel group.

Gradients reach the owners by a reduce-scatter per bucket (parameters of one group and
dtype), launched from post-accumulate-grad hooks during the window's last backward
(``engine.data_parallel``: the overlapped data-parallel path with these buckets): no
communication in earlier micro-steps. Stage 1 keeps each rank's full gradients, as the
paper's stage 1 does; stage 2 drops each parameter's gradient as soon as its bucket is
handed to the reduce-scatter. After the step an all-gather per bucket writes every
rank's updated rows back into the model.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it assigns whole parameters
to ranks (one GPT embedding outweighs 1/8 of the model, so a rank's share is not 1/N),
builds a second optimizer from the class and defaults (the user's optimizer, which the
LR scheduler drives, would stop stepping), takes one process group (experts average
over EXPERT_DATA, the rest over DATA) and leaves naive fp16's fp32 masters whole.
Why not FSDP2 here: stages 1-2 keep parameters whole, so there is nothing to gather
before forward; FSDP2 has no stage 1 (it always reduce-scatters), and its
``reshard_after_forward=False`` frees parameters after backward, turning every
parameter into a DTensor that tensor-parallel layers, pipeline schedules and
``gt.full_state_dict`` would all have to learn. Stage 3 is FSDP2 (``fsdp.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gridtrain.engine.data_parallel import OverlappedDataParallel
from gridtrain.engine.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import set_master
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import copy_tags, get_dp_mode, is_pipeline_shared
from gridtrain.parallel.zero.partition import (
    all_gather_single,
    as_rows,
    chunk_rows,
    owned_range,
    reduce_scatter_single,
    set_owner,
    set_zero_rows,
)

logger = logging.getLogger("gridtrain")


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


class RowBucket:
    """Shards of one data-parallel group and dtype whose rows travel in one collective.

    One rank's segment holds, per shard, a chunk of ``chunk`` rows (zero-padded); the
    flat buffer of a reduce-scatter or all-gather is ``n`` segments, rank by rank.
    ``launch``/``finish`` is the gradient reduce-scatter (the overlapped data-parallel
    path drives them), ``launch_gather``/``finish_gather`` the parameter all-gather.
    """

    def __init__(
        self, shards: list[RowShard], mode: ParallelMode, ctx: ParallelContext, free_grads: bool
    ):
        self.shards, self.mode = shards, mode
        self.group, self.n = ctx.group(mode), ctx.world_size(mode)
        self.free_grads = free_grads
        self.deferred = any(is_pipeline_shared(s.param) for s in shards)  # handler runs first
        self.offsets, self.segment = [], 0
        for s in shards:
            self.offsets.append(self.segment)
            self.segment += s.padded
        self.buffer: Tensor | None = None
        self.work = None

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
        """Wait; each master's gradient becomes its rows of the mean (a view when dtypes agree)."""
        if self.buffer is None:
            raise RuntimeError("RowBucket.finish() called before launch()")
        if self.work is not None:
            self.work.wait()
        for s, off in zip(self.shards, self.offsets):
            if self.n == 1:
                g = s.param.grad
                if self.free_grads:
                    s.param.grad = None
                if g is None:
                    s.master.grad = None
                    continue
                g = g.view(s.master.shape)
            else:
                g = self.buffer[off : off + (s.hi - s.lo) * s.row_numel].view(s.master.shape)
            s.master.grad = g.to(device=s.master.device, dtype=s.master.dtype)
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
        self._gathered = self._gather_work = None


class PartitionedZero:
    """Stages 1-2 of one engine: the row shards, their buckets and the gradient sync.

    ``grad_sync`` is the engine's overlapped data-parallel path over these buckets;
    ``after_step()`` all-gathers the updated rows into the model.
    """

    stage: int

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        ctx: ParallelContext,
        stage: int,
        copy_masters: bool,
        offload: bool = False,
        bucket_size_mb: float = 25.0,
    ):
        if stage not in (1, 2):
            raise ValueError(f"PartitionedZero runs stages 1 and 2, got {stage}")
        self.stage, self.ctx, self.offload = stage, ctx, offload
        self.shards: list[RowShard] = []
        new_of: dict[int, nn.Parameter] = {}
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen or p.numel() == 0 or not p.requires_grad:
                    continue
                seen.add(id(p))
                shard = self._partition(p, get_dp_mode(p, ctx), copy_masters or offload)
                self.shards.append(shard)
                new_of[id(p)] = shard.master
                state = optimizer.state.pop(p, None)
                if state is not None:  # loaded before initialize: keep this rank's rows
                    optimizer.state[shard.master] = _owned_state(state, p, shard)
        rebind_optimizer(optimizer, new_of)
        self.buckets = _buckets(self.shards, ctx, stage == 2, bucket_size_mb)
        self.grad_sync = OverlappedDataParallel(model, ctx, buckets=self.buckets)
        logger.info(
            "zero stage %d: %d parameters in %d buckets, masters %s%s",
            stage,
            len(self.shards),
            len(self.buckets),
            "copied" if copy_masters or offload else "viewed",
            " on CPU" if offload else "",
        )

    def _partition(self, p: Tensor, mode: ParallelMode, copy: bool) -> RowShard:
        n, rank = self.ctx.world_size(mode), self.ctx.local_rank(mode)
        rows = as_rows(p.data).shape[0]
        lo, hi = owned_range(rows, n, rank)
        owned = as_rows(p.data)[lo:hi]
        if copy:
            device = torch.device("cpu") if self.offload else p.device
            pin = self.offload and torch.cuda.is_available()
            data = torch.empty(owned.shape, dtype=torch.float32, device=device, pin_memory=pin)
            master = nn.Parameter(data.copy_(owned), requires_grad=True)
            set_master(p, master)  # dense state reads and loads the copy the optimizer steps
        else:
            master = nn.Parameter(owned, requires_grad=True)  # shares the model's storage
        copy_tags(p, master)
        set_zero_rows(master, mode, lo, rows)
        set_owner(master, p)
        return RowShard(p, master, mode, n, rank, is_view=not copy)

    @contextlib.contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Around a backward: in the window's last one, reduce-scatter buckets as they fill."""
        if not last:
            yield
            return
        with self.grad_sync.overlap():
            yield

    def finish_grad_sync(self) -> None:
        self.grad_sync.finish()

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every rank's updated rows into the model's parameters."""
        for bucket in self.buckets:
            bucket.launch_gather()
        for bucket in self.buckets:
            bucket.finish_gather()

    @torch.no_grad()
    def masters_from_model(self) -> None:
        """Copy the model's rows into copied masters (after loading weights into the model)."""
        for s in self.shards:
            if not s.is_view:
                s.master.copy_(as_rows(s.param.data)[s.lo : s.hi])

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        """(model parameter, optimizer parameter) pairs."""
        return [(s.param, s.master) for s in self.shards]


def _owned_state(state: dict, p: Tensor, shard: RowShard) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape == p.shape:
            value = value[shard.lo : shard.hi].clone().to(shard.master.device)
        out[key] = value
    return out


def _buckets(
    shards: list[RowShard], ctx: ParallelContext, free_grads: bool, bucket_size_mb: float
) -> list[RowBucket]:
    """Buckets in reverse parameter order (backward's order), tied pipeline weights last.

    The order depends only on the model, so every rank of a group issues the same
    collectives in the same order.
    """
    cap = bucket_size_mb * 2**20
    buckets: list[RowBucket] = []
    deferred: list[RowBucket] = []
    open_: dict[tuple, tuple[list[RowShard], int]] = {}
    for s in reversed(shards):
        key = (s.mode, s.param.dtype, s.param.device, is_pipeline_shared(s.param))
        members, size = open_.get(key, ([], 0))
        members.append(s)
        size += s.param.numel() * s.param.element_size()
        if size >= cap:
            (deferred if key[3] else buckets).append(RowBucket(members, s.mode, ctx, free_grads))
            members, size = [], 0
        open_[key] = (members, size)
    for key, (members, _) in open_.items():
        if members:
            (deferred if key[3] else buckets).append(RowBucket(members, key[0], ctx, free_grads))
    return buckets + deferred
