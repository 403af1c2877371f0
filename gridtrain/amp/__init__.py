"""Mixed precision: torch autocast, naive fp16 with master weights, bf16."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim import Optimizer

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.config import AMP_TYPE

logger = logging.getLogger("gridtrain")


def convert_to_amp(
    model: nn.Module, optimizer: Optimizer, ctx, zero=None
) -> tuple[nn.Module, Optimizer | AmpOptimizer, torch.dtype | None]:
    """Apply ``ctx.config.fp16``: returns (model, optimizer, autocast dtype or None).

    TORCH: fp32 model under fp16 autocast, GradScaler. BF16: bf16 autocast, no
    scaler. NAIVE: fp16 model, fp32 master weights, dynamic loss scaler. APEX:
    ``apex.amp.initialize`` with ``opt_level``. No ``fp16`` section: unchanged.
    ``zero`` (``parallel.zero.build_zero``'s result): the optimizer already steps
    sharded rows; the overflow check then covers every rank (ShardedGradScaler for
    TORCH) and naive fp16's masters are those rows (stage 3: FSDP2 computes in fp16).
    """
    cfg = ctx.config.fp16
    if cfg is None or cfg.mode is None:
        return model, optimizer, None
    mode = AMP_TYPE(cfg.mode)
    if mode is AMP_TYPE.TORCH:
        from gridtrain.amp.torch_amp import TorchAmpOptimizer, autocast_dtype

        dtype = autocast_dtype(ctx.device, torch.float16)
        logger.info("amp torch: autocast %s on %s with GradScaler", dtype, ctx.device.type)
        return model, TorchAmpOptimizer(optimizer, ctx, cfg, sharded=zero is not None), dtype
    if mode is AMP_TYPE.BF16:
        logger.info("amp bf16: autocast bfloat16 on %s, no loss scaling", ctx.device.type)
        return model, AmpOptimizer(optimizer), torch.bfloat16
    if mode is AMP_TYPE.NAIVE:
        from gridtrain.amp.naive_amp import NaiveAmpModel, NaiveAmpOptimizer
        from gridtrain.amp.scaler import DynamicLossScaler

        scaler = DynamicLossScaler(
            initial_scale=cfg.initial_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
            hysteresis=cfg.hysteresis,
            min_scale=cfg.min_scale,
            max_scale=cfg.max_scale,
            verbose=cfg.verbose,
        )
        if zero is not None:
            from gridtrain.amp.sharded_naive_amp import ShardedNaiveAmpOptimizer

            logger.info("amp naive under zero %d: fp32 masters sharded", zero.stage)
            optimizer = ShardedNaiveAmpOptimizer(optimizer, ctx, scaler, zero)
            return (model if zero.stage == 3 else NaiveAmpModel(model)), optimizer, None
        optimizer = NaiveAmpOptimizer(optimizer, ctx, scaler)  # masters from the fp32 weights
        logger.info("amp naive: fp16 model on %s, fp32 master weights", ctx.device.type)
        return NaiveAmpModel(model), optimizer, None
    from gridtrain.amp.apex_amp import apex_initialize

    model, optimizer = apex_initialize(model, optimizer, cfg.opt_level)
    return model, optimizer, None


__all__ = ["AMP_TYPE", "AmpOptimizer", "convert_to_amp"]
