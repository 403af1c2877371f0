"""gridtrain.initialize: turn a model, optimizer and loss into an Engine under the context's config.

In order: the tensor plan is made and checked (nothing moves until it fits),
the model's layers are replaced by their mode's sharded layers and the
optimizer is rebound to the new parameters; the pipeline stage is cut; a model
built under ``gt.lazy_init`` materialises what this rank holds; parameters are
broadcast over their data-parallel groups; mixed precision and gradient
handlers are applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gridtrain.amp import convert_to_amp
from gridtrain.engine.compile import compile_criterion, compile_model, compiled_by_gridtrain
from gridtrain.engine.engine import Engine
from gridtrain.engine.fused_optimizer import use_fused_kernels
from gridtrain.engine.grad_sync import build_grad_sync
from gridtrain.engine.recompute import apply_activation_checkpoint, block_types
from gridtrain.engine.schedules import NonPipelineSchedule
from gridtrain.engine.speed import resolve_speed
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.materialize import materialise
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.tags import default_dp_mode, get_dp_mode
from gridtrain.parallel.tensor.chunked_loss import ChunkedHead
from gridtrain.parallel.tensor.coverage import coverage_notice
from gridtrain.parallel.tensor.parallelize import apply_plan, build_plan, find_heads
from gridtrain.parallel.tensor.plan import ModelAdapter, Plan
from gridtrain.parallel.tensor.registry import spec_of
from gridtrain.parallel.zero import build_zero

logger = logging.getLogger("gridtrain")


@torch.no_grad()
def broadcast_from_first_replica(model: nn.Module, ctx: ParallelContext) -> None:
    """Make every data-parallel replica start from the first one's parameters and buffers."""
    tensors = [(p, get_dp_mode(p, ctx)) for p in model.parameters()]
    tensors += [(b, default_dp_mode(ctx)) for b in model.buffers()]
    for t, mode in tensors:
        if ctx.world_size(mode) == 1:
            continue
        data = t.data.contiguous()
        if data.device != ctx.device:  # kept in CPU memory (ZeRO offload): through the device
            data = data.to(ctx.device)
        comm.broadcast_(data, ctx.ranks(mode)[0], ctx.group(mode))
        if data.data_ptr() != t.data.data_ptr():
            t.data.copy_(data)


def example_from(train_dataloader: Any, model: nn.Module, adapter: ModelAdapter | None) -> Any:
    """An input to trace the model with: the first batch's data, else the adapter's example
    (Hugging Face: the model's ``dummy_inputs``), else None (the planner then builds one from
    the model's entry layer). An iterator is never consumed."""
    if train_dataloader is not None and not isinstance(train_dataloader, Iterator):
        batch = next(iter(train_dataloader))
        if isinstance(batch, tuple | list) and len(batch) == 2:
            return batch[0]
        if isinstance(batch, dict):
            return {k: v for k, v in batch.items() if k != "labels"}
        return batch
    example_input = getattr(adapter, "example_input", None)
    return example_input(model) if example_input is not None else None


def _check_arguments(model, optimizer, criterion) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"initialize: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if criterion is not None and not callable(criterion):
        raise TypeError(f"initialize: criterion must be callable, got {type(criterion).__name__}")


def shard_model(
    model: nn.Module,
    optimizer,
    ctx: ParallelContext,
    example: Any = None,
    adapter: ModelAdapter | None = None,
) -> Plan:
    """Plan and apply tensor parallelism to ``model`` in place; returns the plan (a ``Plan``
    in every layout: with no tensor mode it shows the data / pipeline / ZeRO layout).

    With ``chunked_loss`` the model's heads then return deferred logits (``chunked_loss.py``).
    """
    experts = _prepare(model, optimizer, ctx, adapter)
    plan = build_plan(model, ctx, example, adapter)
    plan.experts = experts
    heads: dict = {}
    if ctx.tensor_mode is not None:
        heads = plan.heads
        new_of = apply_plan(model, plan, ctx, adapter)
        rebind_optimizer(optimizer, new_of, ctx=ctx)
        logger.info("%s", plan)
        notice = coverage_notice(plan, model)
        if notice is not None and ctx.global_rank == 0:
            logger.warning("%s", notice)
    chunked = getattr(ctx.config, "chunked_loss", None)
    if chunked is not None:
        heads = heads or find_heads(model, example)
        for name, (vocab, vocab_split) in heads.items():
            ChunkedHead.enable(
                model.get_submodule(name),
                vocab,
                vocab_split,
                chunked.chunk_tokens,
                chunked.recompute,
            )
    return plan


def _prepare(model: nn.Module, optimizer, ctx: ParallelContext, adapter):
    """The adapter's step before the tensor plan (``gridtrain.hf``: the experts of a MoE model
    spread over EXPERT, which the plan then keeps whole); the printable expert layout, or None."""
    prepare = getattr(adapter, "prepare_model", None)
    if prepare is None:
        return None
    new_of, layout = prepare(model, ctx)
    rebind_optimizer(optimizer, new_of, ctx=ctx)
    return layout


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module | None = None,
    train_dataloader=None,
    test_dataloader=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
    example_inputs: Any = None,
    adapter: ModelAdapter | None = None,
):
    """Build the Engine; returns ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    Reads the context's config: the tensor mode and plan (``parallel.tensor``), pipeline
    stages (``parallel.pipeline``), mixed precision (``fp16``), ``gradient_handler``,
    ``gradient_accumulation``, ``clip_grad_norm``, ``zero``, ``activation_checkpoint``,
    ``fp8`` and the speed keys (unset: the device's defaults; ``engine.speed``). A plain
    PyTorch or Hugging Face model is sharded in place: its Linear, Embedding and norm layers
    become the mode's layers under the same names, starting from its weights, and
    ``optimizer`` (built over the plain parameters) is rebound to the new ones. Where the
    plan is traced, ``example_inputs`` (else the first batch of ``train_dataloader``, else
    the adapter's, a Hugging Face model's ``dummy_inputs``, else an input built from the
    model's entry layer) drives the trace on meta. ``adapter`` is the model library's adapter (its plan, head checks and
    pipeline layers): ``gt.initialize`` passes ``gridtrain.adapters.adapter_for(model)``,
    ``gridtrain.hf`` for a ``transformers`` model. Parameters are then broadcast over their
    data-parallel group, so replicas start equal. With ``zero``, the optimizer is then
    rebound once more, to the rows of each parameter this rank owns. The engine steps
    ``lr_scheduler`` once per optimizer step; do not step it yourself. ``engine.plan``
    shows the layout and each layer's style and shard shape.
    """
    ctx = ctx or get_context()
    cfg = ctx.config
    _check_arguments(model, optimizer, criterion)
    example = example_inputs  # the planner traces where the mode needs it, and chunked_loss
    if example is None and (spec_of(ctx).splits_weights or cfg.chunked_loss is not None):
        example = example_from(train_dataloader, model, adapter)
    plan = shard_model(model, optimizer, ctx, example, adapter)
    recompute = None  # the block classes to checkpoint, seen on the whole model
    if cfg.activation_checkpoint is not None:
        recompute = block_types(model)
    model, optimizer, schedule = _keep_this_stage(model, optimizer, ctx, plan, adapter)
    if criterion is not None and isinstance(criterion, nn.Module):
        criterion.to(ctx.device)
    model, optimizer, criterion, zero, autocast_dtype, speed = _prepare_training(
        model, optimizer, criterion, ctx, recompute
    )
    engine = Engine(
        model,
        optimizer,
        criterion,
        ctx,
        schedule,
        build_grad_sync(model, ctx, zero),  # after amp: buckets are per dtype
        autocast_dtype=autocast_dtype,
        lr_scheduler=lr_scheduler,
        plan=plan,
        zero=zero,
    )
    engine.speed = speed
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _keep_this_stage(model: nn.Module, optimizer, ctx: ParallelContext, plan: Plan, adapter):
    """This rank's pipeline stage of ``model`` (all of it without a pipeline), materialised
    and on its device; returns ``(model, optimizer, schedule)``."""
    cfg = ctx.config
    # ZeRO 3 with offload keeps parameters in CPU memory: the model may exceed the device's
    home = ctx.device
    if cfg.zero is not None and cfg.zero.stage == 3 and cfg.zero.offload:
        home = torch.device("cpu")
    if ctx.pipeline_parallel_size > 1:
        from gridtrain.engine.pipeline import prepare_pipeline

        model, optimizer, schedule = prepare_pipeline(model, optimizer, ctx, adapter)
        plan.stages = model.stage_table  # printed with the plan
    else:
        schedule = NonPipelineSchedule()
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            new_of = materialise([model], home)
            rebind_optimizer(optimizer, new_of, ctx=ctx)
    if home == ctx.device:  # else FSDP2 moves one unit at a time, sharding it on the way
        model.to(ctx.device)
    return model, optimizer, schedule


def _prepare_training(model: nn.Module, optimizer, criterion, ctx: ParallelContext, recompute):
    """This rank's part of the model, ready to train: replicas made equal, then fp8,
    activation checkpointing, compile, ZeRO, mixed precision and fused optimizer kernels,
    in the order each needs, as the speed keys resolve on this device (``Speed``, which
    records what was compiled and fused).

    Returns ``(model, optimizer, criterion, zero runtime or None, autocast dtype or None,
    speed)``.
    """
    cfg = ctx.config
    speed = resolve_speed(cfg, ctx.device)
    broadcast_from_first_replica(model, ctx)
    if cfg.fp8 is not None:  # same parameters, float8 matmuls: before compile traces them
        from gridtrain.amp.fp8 import convert_to_fp8

        convert_to_fp8(model, cfg.fp8)
    if recompute is not None:  # inside compile's graphs, outside hooks
        apply_activation_checkpoint(model, cfg.activation_checkpoint, recompute, ctx.rng)
    if speed.compile is not None:  # the blocks' forwards; hooks added later stay outside
        speed.compiled = compile_model(model, speed.compile, ctx)
        criterion = compile_criterion(criterion, speed.compile, ctx)
        speed.compiled += ["criterion"] if compiled_by_gridtrain(criterion) else []
    zero = build_zero(model, optimizer, ctx)  # rebinds the optimizer to this rank's rows
    model, optimizer, autocast_dtype = convert_to_amp(model, optimizer, ctx, zero)
    if speed.fused_optimizer:  # the final parameters: shards, rows, masters, DTensors
        speed.optimizer = use_fused_kernels(optimizer, ctx.device)
    return model, optimizer, criterion, zero, autocast_dtype, speed
