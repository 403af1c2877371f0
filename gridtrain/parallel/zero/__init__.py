"""ZeRO over each parameter's data-parallel group: ``zero = dict(stage=1 | 2 | 3, offload=...)``.

* stage 1 (``stage12``): each rank's optimizer steps only its rows of every
  parameter (state and fp32 masters sharded); gradients reduce-scattered at the end
  of the window, every rank keeping its full gradients; rows all-gathered after the step.
* stage 2 (``stage12``): as 1, but gradients are reduce-scattered into the row
  accumulators in every backward (micro-step, pipeline micro-batch) and each is dropped
  once its bucket has it: a rank holds its rows plus the buckets in flight.
* stage 3 (``fsdp``): FSDP2 ``fully_shard``, parameters sharded too; gradients
  reduce-scattered in every backward (``keep_unsharded_grads``: the window's last only).
* stage 3 with ``offload=True`` (``offload``, Gemini): fp32 masters, gradients and Adam
  state in pinned host memory (1/n of the rows per rank), compute-dtype parameters on the
  device where they fit (``device_param_mb``) and streamed chunk by chunk where not.

``parallel/rows.py`` says which rows a rank owns (the same at every stage, so checkpoints move
between stages); ``memory`` measures what a rank holds. Each runtime is the engine's
gradient sync (``parallel.sync.GradSync``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer

from gridtrain.config import AMP_TYPE, ConfigError
from gridtrain.parallel.context import ParallelContext

if TYPE_CHECKING:
    from gridtrain.parallel.zero.fsdp import FsdpZero
    from gridtrain.parallel.zero.offload import OffloadZero
    from gridtrain.parallel.zero.stage12 import Stage12Zero


def build_zero(
    model: nn.Module, optimizer: Optimizer, ctx: ParallelContext
) -> Stage12Zero | FsdpZero | OffloadZero | None:
    """Apply the config's ``zero`` section to ``model`` and rebind ``optimizer`` (a torch
    optimizer, before mixed precision wraps it); None without one.

    Called by ``gt.initialize`` after the pipeline cut and the data-parallel broadcast.
    """
    cfg = ctx.config.zero
    if cfg is None:
        return None
    fp16 = ctx.config.fp16
    amp = AMP_TYPE(fp16.mode) if fp16 is not None and fp16.mode is not None else None
    if amp is AMP_TYPE.APEX:
        raise ConfigError(
            "zero does not combine with fp16 mode 'apex' (apex patches the optimizer it "
            "would shard); use AMP_TYPE.NAIVE, TORCH or BF16"
        )
    if cfg.stage == 3 and cfg.offload:
        from gridtrain.parallel.zero.offload import OffloadZero

        return OffloadZero(
            model,
            optimizer,
            ctx,
            amp=amp,
            device_param_mb=cfg.device_param_mb,
            delayed_update=cfg.delayed_update,
        )
    if cfg.stage == 3:
        from gridtrain.parallel.zero.fsdp import FsdpZero

        return FsdpZero(
            model, optimizer, ctx, amp=amp, keep_unsharded_grads=cfg.keep_unsharded_grads
        )
    from gridtrain.parallel.zero.stage12 import Stage12Zero

    return Stage12Zero(
        model,
        optimizer,
        ctx,
        cfg.stage,
        copy_masters=amp is AMP_TYPE.NAIVE,
        offload=cfg.offload,
        bucket_size_mb=cfg.bucket_size_mb,
    )


__all__ = ["build_zero"]
