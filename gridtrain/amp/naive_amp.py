"""Naive fp16: the model computes in fp16, the optimizer steps fp32 master weights.

Gradients arrive on the fp16 parameters scaled by the dynamic loss scale; they
are copied into fp32 master gradients and unscaled, an overflow on any rank
skips the step on every rank (flag all-reduced over GLOBAL), and after a step
the masters are copied back into the fp16 model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.amp.scaler import DynamicLossScaler
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import set_master
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import copy_tags


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple | list):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the mapping's own type: a transformers ModelOutput stays one
        for k, v in obj.items():
            out[k] = _cast_floats(v, dtype)
        return out
    return obj


class NaiveAmpModel(nn.Module):
    """The user's module cast to fp16; floating inputs go in as fp16, outputs come out fp32."""

    gt_wrapper = True  # sharding.unwrap() sees through it

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.module = module.to(dtype)
        self.dtype = dtype

    def __getattr__(self, name: str) -> Any:
        # a thin wrapper: attributes it lacks (a pipeline stage's, a model's helpers) are the module's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*_cast_floats(args, self.dtype), **_cast_floats(kwargs, self.dtype))
        return _cast_floats(out, torch.float32)


class NaiveAmpOptimizer(AmpOptimizer):
    """Steps fp32 master copies of the model's parameters under a dynamic loss scale.

    Build it *before* casting the model to fp16, so the masters start from the
    exact fp32 weights.
    """

    def __init__(self, optim: Optimizer, ctx: ParallelContext, scaler: DynamicLossScaler):
        super().__init__(optim)
        self.ctx = ctx
        self.scaler = scaler
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (model param, fp32 master)
        self._model_of: dict[int, Tensor] = {}
        for group in optim.param_groups:
            masters = []
            for p in group["params"]:
                master = nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                copy_tags(p, master)  # masters are sharded, averaged and clipped as p is
                set_master(p, master)  # dense state reads and loads the master
                if p in optim.state:  # state loaded before initialize() moves to the master
                    optim.state[master] = optim.state.pop(p)
                self._pairs.append((p, master))
                self._model_of[id(master)] = p
                masters.append(master)
            group["params"] = masters

    def model_param_for(self, param: Tensor) -> Tensor:
        return self._model_of.get(id(param), param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self._pairs:
            p.grad = None
            master.grad = None

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss.float() * self.scaler.scale

    @torch.no_grad()
    def unscale_and_check(self) -> bool:
        # one fused unscale + inf check over all gradients (as torch's GradScaler does)
        with_grad = [(p, m) for p, m in self._pairs if p.grad is not None]
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
        grads = [p.grad.float() for p, _ in with_grad]
        overflow = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.scaler.scale, device=self.ctx.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, overflow, inv_scale)
        for (_, master), g in zip(with_grad, grads):
            master.grad = g
        comm.all_reduce_(
            overflow, self.ctx.group(ParallelMode.GLOBAL), op=torch.distributed.ReduceOp.MAX
        )
        return bool(overflow.item())

    @torch.no_grad()
    def step(self) -> None:
        self.optim.step()
        self.sync_model_from_masters()

    def update_scale(self, overflow: bool) -> None:
        self.scaler.update(overflow)

    @torch.no_grad()
    def sync_model_from_masters(self) -> None:
        """Copy the masters into the fp16 model (after each step, after loading a checkpoint)."""
        if self._pairs:
            params, masters = zip(*self._pairs)
            torch._foreach_copy_(list(params), list(masters))

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        """(fp16 model parameter, fp32 master) pairs."""
        return list(self._pairs)
