"""What one rank holds: bytes of parameters, gradients and optimizer state.

Counts each tensor's local part (a DTensor's local shard) and each storage once, so a
stage 1-2 master that views the model's rows is not counted twice. Under ZeRO,
``optimizer.state`` holds only this rank's share (torch's Optimizer API), so
``optimizer_state_bytes(engine.optimizer)`` is that share.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from gridtrain.parallel.zero.rows import local


def _inner(optimizer):
    return getattr(optimizer, "optim", optimizer)


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
    state = _inner(optimizer).state
    tensors = (v for s in state.values() for v in s.values() if isinstance(v, Tensor))
    return _bytes(tensors, {})


def memory_report(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds: ``parameters`` (the model's, as they rest between steps),
    ``masters`` (the optimizer's parameters where they are not the model's: fp32 copies),
    ``gradients`` (of both), ``optimizer_state`` and their ``total``."""
    seen: dict[int, list[tuple[int, int]]] = {}
    params = list(model.parameters())
    out = {"parameters": _bytes(params, seen)}
    opt_params = [p for g in _inner(optimizer).param_groups for p in g["params"]]
    out["masters"] = _bytes(opt_params, seen)
    grads = [p.grad for p in params + opt_params if p.grad is not None]
    out["gradients"] = _bytes(grads, seen)
    out["optimizer_state"] = optimizer_state_bytes(optimizer)
    out["total"] = sum(out.values())
    return out
