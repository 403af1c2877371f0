"""Metric records and the reduction that makes a metric the same number on every rank.

A rank's loss or accuracy counts cover the batch its data-parallel rank drew
(tensor-parallel ranks of one replica already agree, the criterion and
``gt.nn.accuracy`` reduce over their groups); under pipeline parallelism only
the last stage has them. ``reduce_to_all`` sums a vector of such partial sums
over the data-parallel ranks and hands the last stage's result to every stage,
so every rank of the world ends up with the same totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gridtrain.parallel.comm import all_reduce_, all_reduce_max
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode


@dataclass
class MetricRecord:
    """One metric's history: a value per step (train loss, lr) and per epoch.

    ``step_at[i]`` is the global step (1-based) of ``step[i]``; ``epoch_step[i]``
    is the trainer's global step when ``epoch[i]`` was recorded (so test results
    can be drawn on the training-step axis).
    """

    name: str
    step: list[float] = field(default_factory=list)
    step_at: list[int] = field(default_factory=list)
    epoch: list[float] = field(default_factory=list)
    epoch_step: list[int] = field(default_factory=list)

    def add_step(self, value: float, at_step: int) -> None:
        self.step.append(float(value))
        self.step_at.append(at_step)

    def add_epoch(self, value: float, at_step: int = -1) -> None:
        self.epoch.append(float(value))
        self.epoch_step.append(at_step)

    @property
    def last(self) -> float | None:
        """The latest epoch value, else the latest step value, else None."""
        if self.epoch:
            return self.epoch[-1]
        return self.step[-1] if self.step else None


def has_metric_values(ctx: ParallelContext) -> bool:
    """Whether this rank computes losses and outputs (the last pipeline stage)."""
    if not ctx.is_initialized(ParallelMode.PIPELINE):
        return True
    return ctx.is_last_rank(ParallelMode.PIPELINE)


def reduce_to_all(values: Tensor, ctx: ParallelContext) -> Tensor:
    """Sum ``values`` over data-parallel replicas, as held by the last pipeline stage,
    returned in float64 on every rank of the world (a collective: call on all ranks)."""
    total = values.detach().to(device=ctx.device, dtype=torch.float64).clone()
    if not has_metric_values(ctx):
        total.zero_()  # earlier stages contribute nothing to the pipeline sum below
    if ctx.is_initialized(ParallelMode.DATA):
        all_reduce_(total, ctx.group(ParallelMode.DATA))
    if ctx.is_initialized(ParallelMode.PIPELINE):
        all_reduce_(total, ctx.group(ParallelMode.PIPELINE))
    return total.cpu()


def max_over_world(value: float, ctx: ParallelContext) -> float:
    """The largest ``value`` over all ranks (e.g. the slowest rank's elapsed time)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    return float(all_reduce_max(t, ctx.group(ParallelMode.GLOBAL)).item())
