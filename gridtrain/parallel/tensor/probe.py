"""Probing what a module subclass computes, on random values: the planner replaces a layer
only where its replacement computes what the module does.

A subclass of ``nn.Linear`` with a forward of its own (a LoRA-style extra path, a router that
returns scores, a head with a soft cap) is not a Linear to the planner unless that forward
gives ``F.linear``'s values (``computes_linear``): otherwise the module is kept whole and its
own forward runs, where a column- or row-parallel Linear would drop what it adds. The probe
runs on a small CPU stand-in of every tensor (the model's may be on meta), once per class
and shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROBE_ROWS = 64  # output rows probed: a large head is probed on its first rows
_LINEAR: dict = {}  # (class, weight shape, has bias) -> computes F.linear


def stand_ins(module: nn.Module, gen: torch.Generator, **given: Tensor) -> dict[str, Tensor]:
    """Random float64 CPU tensors for every parameter and buffer of ``module`` (ones for
    integer ones), for ``torch.func.functional_call``; ``given`` replaces some by name."""
    out = dict(given)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name in given:
            continue
        if t.is_floating_point():
            out[name] = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        else:
            out[name] = torch.ones(t.shape, dtype=t.dtype)
    return out


def computes_linear(module: nn.Linear) -> bool:
    """Whether ``module`` (an ``nn.Linear``, possibly a subclass) computes ``x W^T + b``."""
    if type(module).forward is nn.Linear.forward:
        return True
    key = (type(module), tuple(module.weight.shape), module.bias is not None)
    if key not in _LINEAR:
        _LINEAR[key] = _probe(module)
    return _LINEAR[key]


def _probe(module: nn.Linear) -> bool:
    gen = torch.Generator().manual_seed(0)
    rows = min(module.weight.shape[0], PROBE_ROWS)
    w = torch.randn(rows, module.weight.shape[1], generator=gen, dtype=torch.float64)
    b = torch.randn(rows, generator=gen, dtype=torch.float64) if module.bias is not None else None
    given = {"weight": w} if b is None else {"weight": w, "bias": b}
    x = torch.randn(3, module.weight.shape[1], generator=gen, dtype=torch.float64)
    want = F.linear(x, w, b)
    try:
        y = torch.func.functional_call(module, stand_ins(module, gen, **given), (x,))
        # a forward computing in float32 (a head upcasting its input) is still F.linear
        return y.shape == want.shape and torch.allclose(y.double(), want, rtol=1e-4, atol=1e-5)
    except Exception:  # noqa: BLE001 - a forward that needs more than a Linear has: not one
        return False
