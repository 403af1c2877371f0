"""ZeRO stages 1 and 2: the optimizer steps only this rank's rows of every parameter.

At ``gt.initialize`` the user's optimizer is rebound (``rebind_optimizer``) from each
parameter to a new parameter holding the rows this rank owns (``parallel/rows.py``): a view of
the model's rows when the model trains in its own dtype, an fp32 copy (the master
weight) under naive fp16 or with ``offload`` (then in CPU memory). So optimizer state
and masters exist once across the data-parallel group.

Gradients reach the owners by a reduce-scatter per bucket (``row_buckets.py``: parameters
of one group, dtype and pipeline chunk), launched from post-accumulate-grad hooks and added
into the masters' gradients, this rank's row accumulators (fp32 where the masters are
copies). Stage 1 keeps each rank's full gradients across the window, as the paper's stage 1
does, and reduce-scatters during the window's last backward only
(``parallel.sync.data_parallel``, the overlapped data-parallel path with these buckets): no
communication in earlier micro-steps. Stage 2 reduce-scatters during every backward, every
accumulation micro-step and pipeline micro-batch (``parallel.sync.each_backward``), and drops
each gradient once its bucket has it, so a rank holds its rows plus the buckets in flight
(DeepSpeed's stage 2); tied pipeline weights keep their full gradient until their handler has
summed it, before the step. After the step an all-gather per bucket writes every rank's
updated rows back into the model.

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

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import set_master
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.rows import as_rows, owned_range, set_owner, set_zero_rows
from gridtrain.parallel.sync.base import GradSync
from gridtrain.parallel.sync.data_parallel import OverlappedDataParallel
from gridtrain.parallel.sync.each_backward import EachBackward, pipeline_chunks
from gridtrain.parallel.tags import copy_tags, get_dp_mode
from gridtrain.parallel.zero.memory import Source, grads, state_tensors
from gridtrain.parallel.zero.memory_rules import (
    GRADIENTS,
    IN_FLIGHT_BUCKETS,
    MASTERS,
    OPTIMIZER_STATE,
    PARAMETERS,
    reduces_each_backward,
)
from gridtrain.parallel.zero.row_buckets import RowShard, build_row_buckets

logger = logging.getLogger("gridtrain")


class Stage12Zero(GradSync):
    """Stages 1-2 of one engine: the row shards, their buckets and the gradient sync.

    As a ``GradSync``: stage 1's last backward of a window, stage 2's every backward,
    reduce-scatters the buckets as they fill; ``finish()`` sends the rest and waits,
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
            raise ValueError(f"Stage12Zero runs stages 1 and 2, got {stage}")
        self.stage, self.ctx, self.offload = stage, ctx, offload
        self.shards: list[RowShard] = []
        new_of: dict[int, nn.Parameter] = {}
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen or p.numel() == 0 or not p.requires_grad:
                    continue
                seen.add(id(p))
                shard = self._own_rows(p, get_dp_mode(p, ctx), copy_masters or offload)
                self.shards.append(shard)
                new_of[id(p)] = shard.master
                state = optimizer.state.pop(p, None)
                if state is not None:  # loaded before initialize: keep this rank's rows
                    optimizer.state[shard.master] = shard.owned_state(state, shard.master.device)
        rebind_optimizer(optimizer, new_of)
        each = reduces_each_backward(stage)
        chunks = pipeline_chunks(model) if each else {}
        self.buckets = build_row_buckets(self.shards, ctx, each, bucket_size_mb, chunks)
        if each:
            self._sync: GradSync = EachBackward(self.buckets, IN_FLIGHT_BUCKETS)
        else:
            self._sync = OverlappedDataParallel(model, ctx, buckets=self.buckets)
        logger.info(
            "zero stage %d: %d parameters in %d buckets, masters %s%s",
            stage,
            len(self.shards),
            len(self.buckets),
            "copied" if copy_masters or offload else "viewed",
            " on CPU" if offload else "",
        )

    def _own_rows(self, p: Tensor, mode: ParallelMode, copy: bool) -> RowShard:
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

    def around_backward(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Stage 1: in the window's last backward, reduce-scatter buckets as they fill (stage
        2 does in every backward, whatever wraps it)."""
        return self._sync.around_backward(last)

    def finish(self) -> None:
        self._sync.finish()

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every rank's updated rows into the model's parameters."""
        for bucket in self.buckets:
            bucket.launch_gather()
        self.probe()  # every bucket's all-gather buffers are held now
        for bucket in self.buckets:
            bucket.finish_gather()

    def set_probe(self, probe) -> None:
        super().set_probe(probe)
        self._sync.set_probe(probe)

    def memory_sources(self, model: nn.Module, optimizer) -> list[Source]:
        """What this rank holds, by category (``memory.count``): offloaded masters, their
        gradients and the optimizer state in host memory."""
        host = True if self.offload else None
        masters = [s.master for s in self.shards]
        return [
            (PARAMETERS, list(model.parameters()), None),
            (MASTERS, masters, host),
            (GRADIENTS, grads(model.parameters()), None),
            (GRADIENTS, grads(masters), host),
            (OPTIMIZER_STATE, state_tensors(optimizer), host),
        ]

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        """(model parameter, optimizer parameter) pairs."""
        return [(s.param, s.master) for s in self.shards]
