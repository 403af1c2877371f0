"""How a model cuts a Linear's output before using it: what tells a fused projection's packing.

A column split gives each rank a contiguous block of a Linear's output features. That is
each rank's heads when the output is ``[heads x head_dim]``, or when a fused projection
interleaves q, k and v per head (GPT-NeoX, Bloom: ``view(..., heads, 3 * head_dim)`` then a
cut along the inner dim). It is wrong for a projection packing whole blocks one after the
other (GPT-2's ``[q | k | v]``, a fused ``[gate | up]``): the model cuts those straight off
the output's last dim (``split``, ``chunk``, ``qkv[..., :q]``), or along the outer factor of a
reshaped output (``view(..., heads + 2, head_dim)`` then ``[..., :heads, :]``).

``CutTracker`` watches, during the meta trace, every Linear's output and the reshapes of it
that keep its leading dims, and records each cut (``Cut``): the widths of pieces cut
straight off the last dim, and whether a reshaped output was cut along an outer or an inner
factor. ``packing`` reads one Linear's record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_VIEWS = {
    Tensor.view,
    Tensor.reshape,
    torch.reshape,
    Tensor.unflatten,
    torch.unflatten,
    Tensor.contiguous,
    Tensor.to,
    Tensor.float,
    Tensor.type_as,
}
_DIM_CUTS = {  # function -> (position, keyword) of its dim argument
    Tensor.split: (2, "dim"),
    torch.split: (2, "dim"),
    Tensor.chunk: (2, "dim"),
    torch.chunk: (2, "dim"),
    Tensor.tensor_split: (2, "dim"),
    torch.tensor_split: (2, "dim"),
    Tensor.unbind: (1, "dim"),
    torch.unbind: (1, "dim"),
    Tensor.narrow: (1, "dim"),
    torch.narrow: (1, "dim"),
    Tensor.split_with_sizes: (2, "dim"),
}


@dataclass
class Cut:
    """The cuts seen on one Linear's output (module docstring)."""

    widths: list[int] = field(default_factory=list)  # pieces cut straight off the last dim
    outer: bool = False  # a reshaped output cut along its outer factor: packed blocks
    inner: bool = False  # cut along an inner factor: per head, whole under a column split


def packing(cut: Cut | None, out_features: int) -> int | None:
    """How many equal blocks the output packs (1: none, a column split keeps whole heads), or
    None when it packs blocks a column split cannot keep whole (unequal widths, outer cuts)."""
    if cut is None or (not cut.widths and not cut.outer):
        return 1
    if cut.outer or sum(cut.widths) != out_features or len(set(cut.widths)) != 1:
        return None
    return len(cut.widths)


class CutTracker(TorchFunctionMode):
    """Records ``Cut``s of the outputs ``watch`` registers (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.cuts: dict[str, Cut] = {}
        # id -> (tensor, Linear, leading dims kept, output width); the first call's output only
        self._views: dict[int, tuple[Tensor, str, int, int]] = {}
        self._first: dict[str, int] = {}

    def watch(self, name: str, out: Tensor) -> None:
        """``out`` is Linear ``name``'s output (only its first call's output is watched)."""
        if name in self._first or not isinstance(out, Tensor) or out.dim() == 0:
            return
        self._first[name] = id(out)
        self._views[id(out)] = (out, name, out.dim() - 1, out.shape[-1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        src = self._source(args[0] if args else None)
        if src is not None:
            if func in _VIEWS:
                self._view(src, result)
            elif func in _DIM_CUTS:
                self._cut(src, args[0], result, _dim_arg(func, args, kwargs))
            elif func is Tensor.__getitem__:
                self._index(src, args[0], args[1], result)
        return result

    def _source(self, t) -> tuple[str, int, int] | None:
        entry = self._views.get(id(t)) if isinstance(t, Tensor) else None
        if entry is None or entry[0] is not t:
            return None
        return entry[1], entry[2], entry[3]

    def _view(self, src, result) -> None:
        name, lead, width = src
        if not isinstance(result, Tensor) or result.dim() <= lead:
            return
        arg_shape = self._views[self._first[name]][0].shape[:lead]
        if result.shape[:lead] == arg_shape and math.prod(result.shape[lead:]) == width:
            self._views[id(result)] = (result, name, lead, width)

    def _cut(self, src, t: Tensor, result, dim: int) -> None:
        name, lead, _ = src
        dim = dim % t.dim()
        pieces = result if isinstance(result, tuple | list) else [result]
        self._record(
            name, lead, t.dim(), dim, [p.shape[dim] if p.dim() > dim else 1 for p in pieces]
        )

    def _index(self, src, t: Tensor, index, result) -> None:
        name, lead, _ = src
        for dim in _indexed_dims(index, t.dim()):
            width = result.shape[-1] if isinstance(result, Tensor) and result.dim() else 1
            self._record(name, lead, t.dim(), dim, [width])

    def _record(self, name: str, lead: int, ndim: int, dim: int, widths: list[int]) -> None:
        if dim < lead:
            return  # batch or sequence rows: no packing
        cut = self.cuts.setdefault(name, Cut())
        if ndim - lead == 1:
            cut.widths += widths
        elif dim == lead:
            cut.outer = True
        else:
            cut.inner = True


def _dim_arg(func, args, kwargs) -> int:
    pos, key = _DIM_CUTS[func]
    if key in kwargs:
        return kwargs[key]
    return args[pos] if len(args) > pos else 0


def _indexed_dims(index, ndim: int) -> list[int]:
    """The dims an index restricts (an int or a slice that is not ``:``), in ``t``'s dims."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None or isinstance(i, Tensor | list) for i in items):
        return []  # new axes or advanced indexing: not a plain cut
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (ndim - len(items) + 1) + items[at + 1 :]
    return [
        d
        for d, i in enumerate(items)
        if isinstance(i, int) or (isinstance(i, slice) and i != slice(None))
    ]
