"""The meta device's answers, remembered: a planned model's repeated blocks are traced once.

The planner runs the model's forward on the meta device up to three times (``trace.py``:
the entry input, the data flow, each rank's local shapes). Many meta kernels are Python
(torch's decompositions: layer norm, addmm, attention), so a forward on meta costs about
a millisecond per operation, and a model of 32 identical blocks pays it 32 times, on every
rank, at every ``gt.initialize``. ``MetaMemo`` sits below the other modes of a meta run
and answers an operation it has seen with the same function, the same arguments and the
same input metadata (shape, stride, dtype, tensor type) by fresh meta tensors of the shapes
and strides it returned then.

What is never answered from the table, so it always runs: an in-place operation (a name
ending in ``_``, ``__i*__``, ``__setitem__``) or one given ``out=``; any argument that is not
a meta tensor or a plain value (a module, a function, a symbolic size); a result that is
not meta tensors, or that needs grad (its graph cannot be rebuilt); anything under
autocast. A result that was one of the inputs (``x.contiguous()`` of a contiguous ``x``)
is that input again. Metadata of meta tensors is all a trace reads: no values exist.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

LIMIT = 50_000  # entries kept per process; the table starts afresh past it
_TABLE: dict[tuple, Any] = {}
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


class _Skip(Exception):
    """An argument or result the table does not hold."""


class MetaMemo(TorchFunctionMode):
    """Answers repeated meta operations from a process-wide table (module docstring).
    Enter it before the other modes of a meta run, so that they all still see every call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs: list[Tensor] = []
        key = _key(func, args, kwargs, inputs)
        if key is not None and key in _TABLE:
            return _rebuild(_TABLE[key], inputs)
        out = func(*args, **kwargs)
        if key is not None:
            try:
                record = _record(out, inputs)
            except _Skip:
                return out
            if len(_TABLE) >= LIMIT:
                _TABLE.clear()
            _TABLE[key] = record
        return out


def _key(func: Any, args: tuple, kwargs: dict, inputs: list[Tensor]) -> tuple | None:
    name = getattr(func, "__name__", None)
    if name is None or "out" in kwargs or _in_place(name):
        return None
    if any_autocast():
        return None
    try:
        sig = (_sig(args, inputs), _sig(kwargs, inputs))
    except _Skip:
        return None
    return (func, sig, torch.is_grad_enabled(), torch.get_default_dtype())


def any_autocast() -> bool:
    """Whether autocast is on for any device type."""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return check() if check is not None else torch.is_autocast_enabled()


def _in_place(name: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return name.startswith("__i") or name in ("__setitem__", "__delitem__", "__set__")
    return name.endswith("_")


def _sig(v: Any, inputs: list[Tensor]) -> Any:
    """A hashable stand-in for ``v`` that equals another's exactly when a meta kernel must
    answer both alike; tensors are appended to ``inputs`` in order."""
    if isinstance(v, Tensor):
        if v.device.type != "meta" or type(v) not in (Tensor, nn.Parameter):
            raise _Skip
        inputs.append(v)
        return ("T", tuple(v.shape), v.stride(), v.dtype, v.requires_grad, type(v))
    if v is None or v is Ellipsis or isinstance(v, _PLAIN):
        return (type(v), v)  # the type too: 1, 1.0 and True promote differently
    if isinstance(v, slice):
        return ("slice", _sig(v.start, inputs), _sig(v.stop, inputs), _sig(v.step, inputs))
    if isinstance(v, tuple | list):
        return (type(v), tuple(_sig(x, inputs) for x in v))
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return ("dict", tuple((k, _sig(x, inputs)) for k, x in v.items()))
    raise _Skip


def _record(out: Any, inputs: list[Tensor]) -> Any:
    if isinstance(out, Tensor):
        for i, t in enumerate(inputs):
            if out is t:
                return ("input", i)
        if out.device.type != "meta" or type(out) is not Tensor or out.requires_grad:
            raise _Skip
        return ("new", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, tuple | list):
        return (type(out), [_record(x, inputs) for x in out])
    raise _Skip


def _rebuild(record: Any, inputs: list[Tensor]) -> Any:
    kind = record[0]
    if kind == "input":
        return inputs[record[1]]
    if kind == "new":
        return torch.empty_strided(record[1], record[2], dtype=record[3], device="meta")
    items = [_rebuild(x, inputs) for x in record[1]]
    if hasattr(kind, "_fields"):  # a namedtuple
        return kind(*items)
    return kind(items)  # tuple, list, torch.return_types
