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

A module torch.compile cannot build (dynamo or inductor raise: no C++ or Triton compiler,
an operator inductor cannot lower) runs eagerly instead, with one warning naming it. An
error the eager forward raises as well (a shape mismatch, a bad argument) is the user's and
is raised as eager raises it. torch lowers a backward graph at its first backward, after
the forward returned: a failure there is raised, not caught (the forward that recorded it
has run compiled). Under autocast, a torch whose AOTAutograd cache ignores the autocast dtype
compiles without that cache (``compile_cache.py``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gridtrain.engine.compile_cache import autocast_safe_cache
from gridtrain.parallel.pipeline.model_stage import StandIn

logger = logging.getLogger("gridtrain")


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean torch.compile failed, not the code it compiles: dynamo's
    (inductor's failures reach the caller wrapped in ``BackendCompilerFailed``, one of
    them) and the compiler errors inductor raises unwrapped."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor import exc as inductor

    found = [TorchDynamoException]
    for name in ("CppCompileError", "InvalidCxxCompiler", "OperatorIssue"):
        found += [getattr(inductor, name)] if hasattr(inductor, name) else []
    unavailable = getattr(torch._dynamo.exc, "TritonUnavailableError", None)
    return tuple(found + ([unavailable] if unavailable is not None else []))


def _why(err: BaseException) -> str:
    """The first line of what made torch.compile fail (the backend's own error, which dynamo
    wraps), with its type."""
    root = getattr(err, "inner_exception", None) or err.__cause__ or err
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__


class GuardedCompile:
    """``compiled`` in place of ``eager`` (a module's forward or a loss function) until
    torch.compile fails on it; then ``eager`` for good, after one warning naming ``what``.

    On a failure the call runs again eagerly: what raises there is the caller's own error
    and propagates; what runs is the answer."""

    def __init__(self, what: str, eager: Callable, compiled: Callable):
        self.what, self.eager, self.compiled = what, eager, compiled
        self.first_call_s: float | None = None  # the first call: mostly compiling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        start = time.perf_counter()
        try:
            with autocast_safe_cache():  # torch < 2.12 could load another precision's graph
                out = self.compiled(*args, **kwargs)
        except _compile_errors() as err:
            out = self.eager(*args, **kwargs)  # a user's error raises here, as eager does
            self.compiled = None
            logger.warning(
                "torch.compile failed on %s, which runs eagerly: %s", self.what, _why(err)
            )
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - start
        return out

    @property
    def is_compiled(self) -> bool:
        """Still running the compiled version (False once a failure turned it eager)."""
        return self.compiled is not None


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


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far: dynamo's own count of its
    frame compilations and the backward graphs lowered at their first backward (0.0 where
    torch keeps no count)."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compiled_by_gridtrain(fn: Any) -> bool:
    """Whether ``fn`` (a function or a module) runs through ``compile_model`` or
    ``compile_criterion``'s compiled version, not yet turned eager by a failure."""
    guarded = fn if isinstance(fn, GuardedCompile) else getattr(fn, "forward", None)
    return isinstance(guarded, GuardedCompile) and guarded.is_compiled


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
    for name, module in blocks:
        # the instance's forward, not module.compile(): hooks stay outside the graph
        what = f"block {name!r}" if name else f"the model ({type(module).__name__})"
        eager = module.forward
        module.forward = GuardedCompile(what, eager, torch.compile(eager, **kwargs))
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
        eager = criterion.forward
        what = f"the criterion ({type(criterion).__name__})"
        criterion.forward = GuardedCompile(what, eager, torch.compile(eager, **kwargs))
    else:
        what = f"the criterion ({getattr(criterion, '__name__', type(criterion).__name__)})"
        criterion = GuardedCompile(what, criterion, torch.compile(criterion, **kwargs))
    logger.info("compiled the criterion with %s", options.backend)
    return criterion
