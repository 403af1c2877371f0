"""What ``gt.initialize`` does when ``parallel.pipeline > 1``: cut the model, rebind the optimizer,
pick the schedule."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim import Optimizer

from gridtrain.config import ConfigError
from gridtrain.engine.schedules import PipelineSchedule, pipeline_schedule
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.pipeline.p2p import first_last_stage_group
from gridtrain.parallel.pipeline.partition import PipelineStage, build_stage
from gridtrain.parallel.tags import is_pipeline_shared, pipeline_tie

logger = logging.getLogger("gridtrain")


def check_pipeline_config(ctx: ParallelContext) -> tuple[int, int]:
    """(num_microbatches, num_chunks), or a ConfigError naming the key; no communication."""
    cfg = ctx.config
    pipeline = ctx.world_size(ParallelMode.PIPELINE)
    chunks = cfg.parallel.pipeline.num_chunks
    m = cfg.num_microbatches
    if m is None:
        raise ConfigError(
            f"parallel.pipeline = {pipeline} needs num_microbatches in the config "
            f"(e.g. num_microbatches = {2 * pipeline})"
        )
    try:  # checked at load; again here for keys set on the config after it
        cfg.parallel.pipeline.check_microbatches(m)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return m, chunks


def prepare_pipeline(
    model: nn.Module, optimizer: Optimizer | None, ctx: ParallelContext, adapter=None
) -> tuple[PipelineStage, Optimizer | None, PipelineSchedule]:
    """Keep this rank's stage of ``model``; returns (stage module, optimizer, schedule).

    Called by ``gt.initialize`` on every rank when ``parallel.pipeline > 1``,
    before amp wrapping and gradient handlers. The schedule is the one
    ``parallel.pipeline.schedule`` names in ``SCHEDULES`` (by default interleaved when
    ``num_chunks > 1``, else 1F1B). ``adapter``: the model library's (its pipeline layers).
    """
    _, chunks = check_pipeline_config(ctx)
    cfg = ctx.config.parallel.pipeline
    pipeline = ctx.world_size(ParallelMode.PIPELINE)
    on_meta = any(p.is_meta for p in model.parameters())
    stage, new_of = build_stage(
        model,
        ctx.local_rank(ParallelMode.PIPELINE),
        pipeline,
        chunks,
        cfg.partition,
        ctx.device,
        ctx,
        adapter,
    )
    if on_meta:
        _sync_tied_from_first_stage(stage, ctx)
    optimizer = rebind_optimizer(optimizer, new_of, drop_missing=True)
    return stage, optimizer, pipeline_schedule(ctx)


@torch.no_grad()
def _sync_tied_from_first_stage(stage: nn.Module, ctx: ParallelContext) -> None:
    """Freshly materialised tied copies differ between first and last stage: take the first's."""
    shared = sorted((p for p in stage.parameters() if is_pipeline_shared(p)), key=pipeline_tie)
    group = first_last_stage_group(ctx)
    if not shared or group is None:
        return
    first = ctx.ranks(ParallelMode.PIPELINE)[0]
    for p in shared:
        comm.broadcast_(p.data, first, group)
