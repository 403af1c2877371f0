"""Naive fp16 under ZeRO: the fp32 masters are the optimizer's sharded parameters.

Stages 1-2: the model is cast to fp16 (``NaiveAmpModel``) and each rank's masters are
fp32 copies of its rows (``zero.stage12``); stage 3: the model's FSDP2 parameters
are the fp32 masters, computed in fp16 by FSDP2's mixed-precision policy. Either way
the gradients reach the masters already reduced over the data-parallel group, still
multiplied by the loss scale; a rank sees only its rows, so the overflow flag is
agreed over GLOBAL, as torch's ``ShardedGradScaler`` agrees it over its process group.
The scale follows the same ``DynamicLossScaler`` (hysteresis) as unsharded naive fp16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.amp.scaler import DynamicLossScaler
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import local


class ShardedNaiveAmpOptimizer(AmpOptimizer):
    """Loss scaling, unscaling and the overflow check on sharded fp32 masters."""

    def __init__(self, optim: Optimizer, ctx: ParallelContext, scaler: DynamicLossScaler, zero):
        super().__init__(optim)
        self.ctx, self.scaler, self.zero = ctx, scaler, zero
        self._model_of = {id(m): p for p, m in zero.masters()}

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss.float() * self.scaler.scale

    def _params(self) -> list[Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None
        for p in self._model_of.values():
            p.grad = None

    @torch.no_grad()
    def unscale_and_check(self) -> bool:
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in self._params():
            if p.grad is not None:
                g = local(p.grad)
                by_device.setdefault(g.device, []).append(g)
        overflow = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        for device, grads in by_device.items():  # fused unscale + inf check, as GradScaler
            found = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self.scaler.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
            overflow = torch.maximum(overflow, found.to(overflow.device))
        comm.all_reduce_(overflow, self.ctx.group(ParallelMode.GLOBAL), op=dist.ReduceOp.MAX)
        return bool(overflow.item())

    def update_scale(self, overflow: bool) -> None:
        self.scaler.update(overflow)

    def model_param_for(self, param: Tensor) -> Tensor:
        return self._model_of.get(id(param), param)

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        """(fp16 model parameter, fp32 master rows) pairs of stages 1-2; [] at stage 3, whose
        model parameters are the masters."""
        return self.zero.masters()

    @torch.no_grad()
    def sync_model_from_masters(self) -> None:
        """All-gather the masters' rows into the fp16 model (after loading a checkpoint)."""
        self.zero.after_step()
