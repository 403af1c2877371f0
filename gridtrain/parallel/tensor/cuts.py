"""How a model cuts a Linear's output before using it: what tells a fused projection's packing.

A column split gives each rank a contiguous block of a Linear's output features. That is
each rank's heads when the output is ``[heads x head_dim]``, or when a fused projection
interleaves q, k and v per head (GPT-NeoX, Bloom: ``view(..., heads, 3 * head_dim)`` then a
cut along the inner dim). It is wrong for a projection packing whole blocks one after the
other (GPT-2's ``[q | k | v]``, a fused ``[gate | up]``): the model cuts those straight off
the output's last dim (``split``, ``chunk``, ``qkv[..., :q]``), or along the outer factor of a
reshaped output (``view(..., heads + 2, head_dim)`` then ``[..., :heads, :]``).

``CutTracker`` watches, during the meta trace, every Linear's output and the reshapes of it
that keep its leading dims, and records each cut (``Cut``): the widths (in output features)
of pieces cut straight off the last dim or along the outer factor of a reshape, and whether
a reshape was cut along an inner factor. ``packing`` reads one Linear's record.
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
_MOVES = {Tensor.transpose, torch.transpose, Tensor.permute, torch.permute}
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

    widths: list[int] = field(default_factory=list)  # blocks, in output features
    inner: bool = False  # cut along an inner factor: per head, whole under a column split


def packing(cut: Cut | None, out_features: int) -> int | None:
    """How many equal blocks the output packs (1: none, a column split keeps whole heads), or
    None when it packs blocks a column split cannot keep whole (unequal widths)."""
    if cut is None or not cut.widths:
        return 1
    if sum(cut.widths) != out_features or len(set(cut.widths)) != 1:
        return None
    return len(cut.widths)


class CutTracker(TorchFunctionMode):
    """Records ``Cut``s of the outputs ``watch`` registers (see the module docstring).

    Each watched tensor carries its *factor dims*: the dims, outer to inner, that the Linear's
    output features were reshaped into (the last dim alone at first); reshapes keeping the
    leading dims and transposes or permutes carry them along."""

    def __init__(self):
        super().__init__()
        self.cuts: dict[str, Cut] = {}
        # id -> (tensor, Linear, its factor dims, the output's leading shape); first call only
        self._views: dict[int, tuple[Tensor, str, tuple[int, ...], torch.Size]] = {}
        self._seen: set[str] = set()

    def watch(self, name: str, out: Tensor) -> None:
        """``out`` is Linear ``name``'s output (only its first call's output is watched)."""
        if name in self._seen or not isinstance(out, Tensor) or out.dim() == 0:
            return
        self._seen.add(name)
        self._views[id(out)] = (out, name, (out.dim() - 1,), out.shape[:-1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        entry = self._entry(args[0] if args else None)
        if entry is not None:
            if func in _VIEWS:
                self._view(entry, result)
            elif func in _MOVES:
                self._move(entry, func, args, kwargs, result)
            elif func in _DIM_CUTS:
                self._cut(entry, args[0], result, _dim_arg(func, args, kwargs))
            elif func is Tensor.__getitem__:
                for dim, size in _indexed_dims(args[1], args[0].shape):
                    self._record(entry, args[0], dim, [size])
        return result

    def _entry(self, t):
        entry = self._views.get(id(t)) if isinstance(t, Tensor) else None
        return entry if entry is not None and entry[0] is t else None

    def _keep(self, entry, result: Tensor, factors: tuple[int, ...]) -> None:
        self._views[id(result)] = (result, entry[1], factors, entry[3])

    def _view(self, entry, result) -> None:
        """A reshape keeping the output's leading dims: its trailing dims are the factors."""
        _, _, factors, lead_shape = entry
        lead = len(lead_shape)
        if not isinstance(result, Tensor) or result.dim() <= lead or factors[0] != lead:
            return  # a transposed tensor reshaped: no longer followed
        if result.shape[:lead] == lead_shape:
            self._keep(entry, result, tuple(range(lead, result.dim())))

    def _move(self, entry, func, args, kwargs, result) -> None:
        """A transpose or permute: the factors move with their dims."""
        t = args[0]
        order = list(range(t.dim()))
        if func in (Tensor.transpose, torch.transpose):
            a, b = (d % t.dim() for d in args[1:3])
            order[a], order[b] = order[b], order[a]
        else:
            dims = args[1:] if len(args) > 2 or not isinstance(args[1], tuple | list) else args[1]
            order = [d % t.dim() for d in dims]
        self._keep(entry, result, tuple(order.index(f) for f in entry[2]))

    def _cut(self, entry, t: Tensor, result, dim: int) -> None:
        dim = dim % t.dim()
        pieces = result if isinstance(result, tuple | list) else [result]
        kept = all(p.dim() == t.dim() for p in pieces)  # unbind drops the dim: pieces of 1
        self._record(entry, t, dim, [p.shape[dim] if kept else 1 for p in pieces])

    def _record(self, entry, t: Tensor, dim: int, sizes: list[int]) -> None:
        """Pieces of ``sizes`` along ``dim`` of ``t`` (a watched output or a reshape of it)."""
        _, name, factors, _ = entry
        if dim not in factors:
            return  # batch or sequence rows: no packing
        cut = self.cuts.setdefault(name, Cut())
        if dim == factors[0]:  # the last dim itself, or a reshape's outer factor: blocks
            per = math.prod(t.shape[f] for f in factors[1:])
            cut.widths += [s * per for s in sizes]
        else:
            cut.inner = True


def _dim_arg(func, args, kwargs) -> int:
    pos, key = _DIM_CUTS[func]
    if key in kwargs:
        return kwargs[key]
    return args[pos] if len(args) > pos else 0


def _indexed_dims(index, shape: torch.Size) -> list[tuple[int, int]]:
    """(dim, size kept) for each dim an index restricts (an int, or a slice that is not
    ``:``), in the indexed tensor's dims."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None or isinstance(i, Tensor | list) for i in items):
        return []  # new axes or advanced indexing: not a plain cut
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (len(shape) - len(items) + 1) + items[at + 1 :]
    out = []
    for d, i in enumerate(items):
        if isinstance(i, int):
            out.append((d, 1))
        elif isinstance(i, slice) and i != slice(None):
            out.append((d, len(range(*i.indices(shape[d])))))
    return out
