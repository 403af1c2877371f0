"""``compile``: torch.compile applied per repeated block, as torchtitan does.

Compiling the whole model would put every tensor-parallel collective, pipeline
send and ZeRO gather into one graph (or break it at each). Compiling each entry of
the model's repeated block list (``transformer.h``, ``model.layers``, the blocks of
an ``nn.Sequential``) keeps those graphs small and identical, so one compilation
serves every block, and the code between blocks (embeddings, head, loss, pipeline p2p) stays eager.
Only a block's ``forward`` is compiled: module hooks (ZeRO-3's FSDP2 gathers,
gradient sync, BatchNorm broadcast) run eagerly around it. A model without a
block list is compiled whole. On a pipeline stage that runs the model's own forward the
block list holds stand-ins for other stages' blocks: the blocks it keeps are its blocks,
however few.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from gridtrain.parallel.pipeline.model_stage import StandIn

logger = logging.getLogger("gridtrain")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``: in the outermost ``nn.ModuleList`` or
    ``nn.Sequential`` that has them, the children of a class that occurs at least
    twice there and holds submodules (a transformer block, not a lone Linear)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        kept = [(key, m) for key, m in children if not isinstance(m, StandIn)]
        counts = Counter(type(m) for _, m in kept)
        cut = len(kept) < len(children)  # a pipeline stage: other stages' blocks stand in
        blocks = [
            (f"{name}.{key}" if name else key, m)
            for key, m in kept
            if (counts[type(m)] > 1 or cut) and next(m.children(), None) is not None
        ]
        if blocks:
            return blocks
    return []


def _kwargs(options: Any) -> dict[str, Any]:
    return dict(
        backend=options.backend,
        mode=options.mode,
        fullgraph=options.fullgraph,
        dynamic=options.dynamic,
        options=options.options,
    )


def compile_model(model: nn.Module, options: Any, ctx=None) -> list[str]:
    """Compile ``model`` in place per the ``compile`` config section; returns the names
    of the compiled modules ('' is the whole model). State-dict keys do not change.

    ``per_block=None`` compiles per block only where the model holds collectives or
    hooks (a tensor mode, pipeline stages, ZeRO 3); one process or plain data
    parallelism compiles the whole model, which fuses across blocks and launches less."""
    kwargs = _kwargs(options)
    per_block = options.per_block
    if per_block is None:
        zero = getattr(ctx.config, "zero", None) if ctx is not None else None
        per_block = ctx is None or (
            ctx.tensor_mode is not None
            or ctx.pipeline_parallel_size > 1
            or (zero is not None and zero.stage == 3)
        )
    blocks = find_blocks(model) if per_block else []
    if not blocks:
        blocks = [("", model)]
    for _, module in blocks:
        # the instance's forward, not module.compile(): hooks stay outside the graph
        module.forward = torch.compile(module.forward, **kwargs)
    names = [name for name, _ in blocks]
    logger.info("compiled %d module(s) with %s: %s", len(names), options.backend, names[:4])
    return names


def compile_criterion(criterion: Any, options: Any, ctx) -> Any:
    """The criterion compiled per ``compile.loss`` (returned unchanged where it stays eager).

    Eager cross entropy under autocast writes the whole ``[tokens, vocab]`` logits again in
    fp32 and runs softmax over them twice (forward and backward); compiled, one fused
    kernel reads the bf16 logits and the backward writes their gradient directly. A
    module keeps its identity (its instance ``forward`` is compiled), a function is wrapped.
    """
    on = options.loss
    if on is None:
        on = ctx.tensor_mode is None and getattr(ctx.config, "chunked_loss", None) is None
    if not on or criterion is None:
        return criterion
    # the model's backend and shape policy; not its mode (CUDA graphs would hand back a
    # loss the next micro-batch overwrites) nor fullgraph (a user's loss may break a graph);
    # its options, with CUDA graphs kept off for the same reason
    kwargs = {k: v for k, v in _kwargs(options).items() if k not in ("mode", "fullgraph")}
    if kwargs["options"] is not None and options.backend == "inductor":
        kwargs["options"] = {**kwargs["options"], "triton.cudagraphs": False}
    if isinstance(criterion, nn.Module):
        criterion.forward = torch.compile(criterion.forward, **kwargs)
    else:
        criterion = torch.compile(criterion, **kwargs)
    logger.info("compiled the criterion with %s", options.backend)
    return criterion
