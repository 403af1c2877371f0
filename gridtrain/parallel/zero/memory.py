"""What one rank holds: bytes of parameters, gradients, optimizer state and masters.

``count(sources, device)`` is what ``engine.memory()`` reports: each source names a
category (``memory_rules``), its tensors and where they live (host or device); every
storage is counted once, whole (padding and all: the memory it really takes; a storage
freed by ``resize_(0)``, as FSDP2 and Gemini free gathered parameters, counts 0), in the
first category that names it, so a ZeRO 1-2 master viewing the model's rows adds nothing.
``model_sources`` lists them for a model without ZeRO; each ZeRO runtime has its own
``memory_sources``.

``memory_report`` is the older view-based sum (``benchmarks/zero_memory.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from gridtrain.parallel.rows import local
from gridtrain.parallel.zero.memory_rules import GRADIENTS, MASTERS, OPTIMIZER_STATE, PARAMETERS

# (category, tensors, host): host None places a tensor by its device
Source = tuple[str, Iterable[Tensor], bool | None]


def _inner(optimizer):
    return getattr(optimizer, "optim", optimizer)


def grads(tensors: Iterable[Tensor]) -> list[Tensor]:
    return [t.grad for t in tensors if t.grad is not None]


def state_tensors(optimizer) -> list[Tensor]:
    state = _inner(optimizer).state
    return [v for s in state.values() for v in s.values() if isinstance(v, Tensor)]


def optimizer_params(optimizer) -> list[Tensor]:
    return [p for g in _inner(optimizer).param_groups for p in g["params"]]


def model_sources(model: nn.Module, optimizer) -> list[Source]:
    """Without ZeRO: the model's parameters, the optimizer's where they differ (naive fp16's
    fp32 masters), both's gradients, the optimizer state."""
    params, masters = list(model.parameters()), optimizer_params(optimizer)
    return [
        (PARAMETERS, params, None),
        (MASTERS, masters, None),
        (GRADIENTS, grads(params) + grads(masters), None),
        (OPTIMIZER_STATE, state_tensors(optimizer), None),
    ]


def _storage(t: Tensor) -> tuple[tuple, int]:
    """(key, bytes) of the storage under ``t`` (a DTensor's local one)."""
    t = local(t)
    try:
        st = t.untyped_storage()
        return (t.device, st.data_ptr()), st.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return (t.device, id(t)), t.numel() * t.element_size()


def count(sources: Iterable[Source], device: torch.device) -> tuple[dict, dict]:
    """``(on the device, in host memory)``: bytes per category of ``sources``. A source's
    host None: host when the tensor is on the CPU and the rank computes elsewhere."""
    seen: set[tuple] = set()
    on_device = dict.fromkeys((PARAMETERS, MASTERS, GRADIENTS, OPTIMIZER_STATE), 0)
    on_host = dict(on_device)
    for category, tensors, host in sources:
        for t in tensors:
            key, size = _storage(t)
            if size == 0 or key in seen:
                continue
            seen.add(key)
            where = host
            if where is None:
                where = local(t).device.type == "cpu" and device.type != "cpu"
            (on_host if where else on_device)[category] += size
    return on_device, on_host


# ---- the older view-based sums ---------------------------------------------------------------
def _bytes(tensors: Iterable[Tensor], seen: dict[int, list[tuple[int, int]]]) -> int:
    """Bytes of ``tensors``, skipping any lying inside a storage range counted already."""
    total = 0
    for t in tensors:
        t = local(t)
        if t.numel() == 0:
            continue
        size = t.numel() * t.element_size()
        start = t.storage_offset() * t.element_size()
        ranges = seen.setdefault(t.untyped_storage().data_ptr(), [])
        if any(lo <= start and start + size <= hi for lo, hi in ranges):
            continue
        ranges.append((start, start + size))
        total += size
    return total


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (local shards of DTensors)."""
    return _bytes(state_tensors(optimizer), {})


def memory_report(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds: ``parameters`` (the model's, as they rest between steps),
    ``masters`` (the optimizer's parameters where they are not the model's: fp32 copies),
    ``gradients`` (of both), ``optimizer_state`` and their ``total``."""
    seen: dict[int, list[tuple[int, int]]] = {}
    params = list(model.parameters())
    out = {"parameters": _bytes(params, seen)}
    opt_params = optimizer_params(optimizer)
    out["masters"] = _bytes(opt_params, seen)
    out["gradients"] = _bytes(grads(params + opt_params), seen)
    out["optimizer_state"] = optimizer_state_bytes(optimizer)
    out["total"] = sum(out.values())
    return out
