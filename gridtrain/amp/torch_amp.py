"""torch autocast (fp16 or bf16) and torch's GradScaler, with the overflow agreed across the model.

The scale is kept within ``fp16.min_scale``/``max_scale`` as naive fp16's is (GradScaler
has no floor of its own).

GradScaler finds infs on this rank's gradients only; tensor- and pipeline-
parallel ranks hold different gradients, so the found-inf flags are all-reduced
(max) over the MODEL group before the scaler steps, and all ranks skip together.
Data-parallel ranks agree already: their gradients were averaged, infs included;
under ZeRO they hold different rows, so the flags are agreed over GLOBAL.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.config import Fp16Config
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

logger = logging.getLogger("gridtrain")


def autocast_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if this torch autocasts to it on ``device``, else bf16 (old CPU autocast: bf16 only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device.type, dtype=dtype):
            ok = torch.is_autocast_enabled(device.type) and (
                torch.get_autocast_dtype(device.type) == dtype
            )
    if not ok:
        logger.warning("autocast on %s does not support %s; using bfloat16", device.type, dtype)
        return torch.bfloat16
    return dtype


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast region for the forward pass and loss (a no-op when ``dtype`` is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class TorchAmpOptimizer(AmpOptimizer):
    """Loss scaling with ``torch.amp.GradScaler``; the model stays fp32 under autocast."""

    def __init__(
        self, optim: Optimizer, ctx: ParallelContext, cfg: Fp16Config, sharded: bool = False
    ):
        super().__init__(optim)
        self.ctx = ctx
        if not cfg.min_scale <= cfg.initial_scale <= cfg.max_scale:
            raise ValueError(
                f"fp16.initial_scale {cfg.initial_scale} must lie in [min_scale "
                f"{cfg.min_scale}, max_scale {cfg.max_scale}]"
            )
        self.min_scale, self.max_scale = cfg.min_scale, cfg.max_scale
        kwargs = dict(
            init_scale=cfg.initial_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
        )
        # under ZeRO a rank holds only its rows of the gradients: data-parallel ranks no
        # longer agree by themselves, so the flags are agreed over GLOBAL (torch's
        # ShardedGradScaler all-reduces them over the group it is given)
        self._group_mode = ParallelMode.GLOBAL if sharded else ParallelMode.MODEL
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(
                ctx.device.type, process_group=ctx.group(ParallelMode.GLOBAL), **kwargs
            )
        else:
            self.scaler = torch.amp.GradScaler(ctx.device.type, **kwargs)

    def scale_loss(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss)

    def unscale_and_check(self) -> bool:
        return bool(self.unscale_flag().item())

    def unscale_flag(self) -> Tensor:
        """Unscale; the overflow flag agreed over the ranks, left on the device (no host
        sync). ``step()`` then skips on it inside a fused optimizer (GradScaler hands it
        over as ``found_inf``), and ``update_scale`` backs the scale off on the device."""
        self.scaler.unscale_(self.optim)
        # GradScaler keeps its per-device found-inf flags here; step() and update() read them
        per_device = self.scaler._per_optimizer_states[id(self.optim)]["found_inf_per_device"]
        found = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for flag in per_device.values():
            found = torch.maximum(found, flag.to(found.device))
        comm.all_reduce_(found, self.ctx.group(self._group_mode), op=dist.ReduceOp.MAX)
        if not per_device:  # no gradient on this rank: still give update() a flag
            per_device[self.ctx.device] = found.clone()
        for flag in per_device.values():
            flag.copy_(found)
        return found

    def step(self) -> None:
        self.scaler.step(self.optim)

    def update_scale(self, overflow: bool) -> None:
        """GradScaler's update, then the scale held to [min_scale, max_scale] (on the device:
        no sync). GradScaler itself has no floor: a long run of overflows halves its scale
        down to 0, after which the next finite step multiplies the gradients by inf and
        writes NaN into every weight."""
        self.scaler.update()
        scale = getattr(self.scaler, "_scale", None)
        if scale is not None:
            scale.clamp_(self.min_scale, self.max_scale)
