"""gridtrain.initialize: turn a model, optimizer and loss into an Engine under the context's config."""

from __future__ import annotations

import logging

import torch
from torch import nn

from gridtrain.amp import convert_to_amp
from gridtrain.config import GradientHandlerConfig
from gridtrain.engine.data_parallel import OverlappedDataParallel
from gridtrain.engine.engine import Engine
from gridtrain.engine.schedule import NonPipelineSchedule
from gridtrain.gradient_handlers import DATA_PARALLEL_HANDLERS, handler_class
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import get_dp_mode, is_pipeline_shared

logger = logging.getLogger("gridtrain")


@torch.no_grad()
def broadcast_from_first_replica(model: nn.Module, ctx: ParallelContext) -> None:
    """Make every data-parallel replica start from the first one's parameters and buffers."""
    default = ParallelMode.SEQUENCE_DP if ctx.tensor_mode == "sequence" else ParallelMode.DATA
    tensors = [(p, get_dp_mode(p, ctx)) for p in model.parameters()]
    tensors += [(b, default) for b in model.buffers()]
    for t, mode in tensors:
        if ctx.world_size(mode) == 1:
            continue
        data = t.data.contiguous()
        comm.broadcast_(data, ctx.ranks(mode)[0], ctx.group(mode))
        if data.data_ptr() != t.data.data_ptr():
            t.data.copy_(data)


def _any_rank_has_shared(model: nn.Module, ctx: ParallelContext) -> bool:
    """Whether any stage holds tied pipeline weights (the handler's set-up is collective)."""
    if ctx.pipeline_parallel_size == 1:
        return False
    local = any(is_pipeline_shared(p) for p in model.parameters())
    flag = torch.tensor([1.0 if local else 0.0], device=ctx.device)
    comm.all_reduce_(flag, ctx.group(ParallelMode.GLOBAL))
    return flag.item() > 0


def _prepare_pipeline(model, optimizer, ctx):
    try:
        from gridtrain.parallel.pipeline.engine_hooks import prepare_pipeline
    except ModuleNotFoundError as err:
        if err.name != "gridtrain.parallel.pipeline.engine_hooks":
            raise
        raise NotImplementedError(
            f"parallel.pipeline size {ctx.pipeline_parallel_size} needs "
            "gridtrain/parallel/pipeline/engine_hooks.py (prepare_pipeline), which is missing"
        ) from None
    return prepare_pipeline(model, optimizer, ctx)


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module | None = None,
    train_dataloader=None,
    test_dataloader=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
):
    """Build the Engine; returns ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    Reads the context's config: pipeline stages (``parallel.pipeline``), mixed
    precision (``fp16``), ``gradient_handler``, ``gradient_accumulation`` and
    ``clip_grad_norm``. Parameters are broadcast over their data-parallel group
    first, so replicas start equal. With no data-parallel handler named, the
    engine all-reduces gradients during backward (overlapped, bucketed). The
    engine steps ``lr_scheduler`` once per optimizer step; do not step it yourself.
    Data loaders are returned as given (build them with ``gridtrain.data.get_dataloader``).
    """
    ctx = ctx or get_context()
    cfg = ctx.config
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"initialize: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if criterion is not None and not callable(criterion):
        raise TypeError(f"initialize: criterion must be callable, got {type(criterion).__name__}")

    if ctx.pipeline_parallel_size > 1:
        model, optimizer, schedule = _prepare_pipeline(model, optimizer, ctx)
    else:
        schedule = NonPipelineSchedule()
    model.to(ctx.device)
    if criterion is not None and isinstance(criterion, nn.Module):
        criterion.to(ctx.device)
    broadcast_from_first_replica(model, ctx)
    model, optimizer, autocast_dtype = convert_to_amp(model, optimizer, ctx)

    names = [h.type for h in cfg.gradient_handler]
    cfg_handlers = list(cfg.gradient_handler)
    if "PipelineSharedModuleGradientHandler" not in names and _any_rank_has_shared(model, ctx):
        cfg_handlers.append(GradientHandlerConfig(type="PipelineSharedModuleGradientHandler"))
    handlers = [handler_class(h.type)(model, ctx, **h.kwargs) for h in cfg_handlers]
    data_parallel = None
    if not any(n in DATA_PARALLEL_HANDLERS for n in names):
        data_parallel = OverlappedDataParallel(model, ctx)
        if not data_parallel.enabled:
            data_parallel.remove_hooks()
            data_parallel = None
    logger.debug(
        "engine: handlers %s, overlapped data-parallel %s, accumulation %d, clip %g",
        [type(h).__name__ for h in handlers],
        data_parallel is not None,
        cfg.gradient_accumulation,
        cfg.clip_grad_norm,
    )
    engine = Engine(
        model,
        optimizer,
        criterion,
        ctx,
        schedule,
        gradient_handlers=handlers,
        data_parallel=data_parallel,
        autocast_dtype=autocast_dtype,
        lr_scheduler=lr_scheduler,
    )
    return engine, train_dataloader, test_dataloader, lr_scheduler
