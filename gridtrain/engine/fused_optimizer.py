"""``fused_optimizer``: torch's fused Adam, AdamW and SGD kernels for an optimizer built
without them.

A torch optimizer built with neither ``fused`` nor ``foreach`` runs torch's default, the
``foreach`` kernels on CUDA: one launch per operation over a list of tensors. ``fused=True``
does the whole update in one kernel per parameter group and dtype, and lets torch's
GradScaler (and the engine's non-finite skip) stay on the device. Switching after
``initialize`` built everything means the optimizer holds its final parameters: this rank's
shards, ZeRO's rows, fp16 masters or FSDP2's DTensors.

The switch is what the constructor does for ``fused=True`` (the group flag, the default
for groups added later, the GradScaler capability), on the same object: the user's
LR scheduler keeps driving it. It is made only where the constructor would have accepted
it and the choice was left to torch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# the classes with a fused kernel; subclasses may override step, so exact types only
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# torch registers a DTensor sharding rule for the fused Adam kernels, not for fused SGD
FUSED_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)


def why_not_fused(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why ``optimizer`` keeps its kernels (None: it can switch to fused ones on ``device``)."""
    kind = type(optimizer)
    if kind not in FUSED:
        return f"{kind.__name__} has no fused kernel in torch (Adam, AdamW and SGD do)"
    groups = [optimizer.defaults, *optimizer.param_groups]
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return "fused or foreach was given"
    if any(g.get("differentiable") for g in groups):
        return "differentiable=True has no fused kernel"
    if optimizer.state:
        return "it already has state (its step counts live on the host)"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        reason = _param_reason(p, kind, device)
        if reason is not None:
            return reason
    return None if params else "it has no parameters"


def _param_reason(p: Tensor, kind: type, device: torch.device) -> str | None:
    if p.device.type != device.type:  # a DTensor's device is its local shard's
        return f"a parameter lives on {p.device.type}, not {device.type}"
    if not torch.is_floating_point(p):
        return f"a parameter is {p.dtype}, not floating point"
    if isinstance(p, DTensor):
        return None if kind in FUSED_DTENSOR else f"fused {kind.__name__} takes no DTensor"
    if type(p) not in (Tensor, nn.Parameter):
        return f"a parameter is a {type(p).__name__}"
    return None


def use_fused_kernels(optimizer, device: torch.device) -> str:
    """Switch the torch optimizer inside ``optimizer`` (an amp wrapper's ``optim``) to its
    fused kernels where ``why_not_fused`` finds nothing against it, in place; returns
    ``"fused"`` or ``"as built: <why>"``."""
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return f"as built: {type(inner).__name__} is not a torch optimizer"
    reason = why_not_fused(inner, device)
    if reason is not None:
        return f"as built: {reason}"
    inner.defaults["fused"] = True
    for group in inner.param_groups:
        group["fused"] = True
    inner._step_supports_amp_scaling = True  # as the constructor sets for fused=True
    if isinstance(inner, torch.optim.SGD):
        inner._need_device_dtype_check_for_fused = True
    return "fused"
