"""The engine's gradient sync, picked once from the config (``parallel.sync.GradSync``).

* ``zero``: the ZeRO runtime syncs data-parallel gradients itself; a handler that would
  average them too is dropped. Handlers left (tied pipeline weights) run first, since
  they sum full gradients before ZeRO keeps only its rows.
* no data-parallel handler named: the overlapped all-reduce during the last backward
  (``parallel.sync.OverlappedDataParallel``), then the handlers.
* a data-parallel handler named: the handlers, in config order, after backward.

Tied pipeline weights get a ``PipelineSharedModuleGradientHandler`` when no config names one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gridtrain.config import GradientHandlerConfig
from gridtrain.gradient_handlers import DATA_PARALLEL_HANDLERS, handler_class
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sync import GradSync, GradSyncs, OverlappedDataParallel
from gridtrain.parallel.tags import is_pipeline_shared

logger = logging.getLogger("gridtrain")


def build_grad_sync(model: nn.Module, ctx: ParallelContext, zero: GradSync | None) -> GradSync:
    """The sync for ``model`` under ``ctx.config`` (``zero``: ``build_zero``'s runtime, or None).

    Collective over GLOBAL when the pipeline has several stages (tied weights are looked
    for on every stage). Called after mixed precision has cast the model: buckets are per dtype.
    """
    handlers = _handlers(model, ctx, zero)
    if zero is not None:
        parts: list[GradSync] = [*handlers, zero]
    elif any(h.type in DATA_PARALLEL_HANDLERS for h in ctx.config.gradient_handler):
        parts = list(handlers)
    else:
        parts = [*_overlapped(model, ctx), *handlers]
    logger.debug("engine: gradient sync %s", [type(p).__name__ for p in parts])
    if len(parts) == 1:
        return parts[0]
    return GradSyncs(parts) if parts else GradSync()


def _handlers(model: nn.Module, ctx: ParallelContext, zero: GradSync | None) -> list[GradSync]:
    """The configured handlers (less those averaging over data under ZeRO), plus the
    tied-weight handler wherever a stage holds tied pipeline weights."""
    configured = list(ctx.config.gradient_handler)
    names = [h.type for h in configured]
    if zero is not None and any(n in DATA_PARALLEL_HANDLERS for n in names):
        logger.info("zero stage %d reduces gradients itself: %s not used", zero.stage, names)
        configured = [h for h in configured if h.type not in DATA_PARALLEL_HANDLERS]
        names = [h.type for h in configured]
    if "PipelineSharedModuleGradientHandler" not in names and _any_rank_has_shared(model, ctx):
        configured.append(GradientHandlerConfig(type="PipelineSharedModuleGradientHandler"))
    return [handler_class(h.type)(model, ctx, **h.kwargs) for h in configured]


def _overlapped(model: nn.Module, ctx: ParallelContext) -> list[OverlappedDataParallel]:
    """The overlapped all-reduce, or nothing where no parameter has a group of two ranks."""
    overlapped = OverlappedDataParallel(model, ctx)
    if overlapped.enabled:
        return [overlapped]
    overlapped.remove_hooks()
    return []


def _any_rank_has_shared(model: nn.Module, ctx: ParallelContext) -> bool:
    """Whether any stage holds tied pipeline weights (the handler's set-up is collective)."""
    if ctx.pipeline_parallel_size == 1:
        return False
    local = any(is_pipeline_shared(p) for p in model.parameters())
    flag = torch.tensor([1.0 if local else 0.0], device=ctx.device)
    comm.all_reduce_(flag, ctx.group(ParallelMode.GLOBAL))
    return flag.item() > 0
