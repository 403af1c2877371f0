"""The tensor modes by their config names (``parallel.tensor.mode``): name -> ``TensorMode``.

The engine splits batches, ``gt.nn`` picks its loss and accuracy, the planner and
``gridtrain estimate`` plan layers through the spec found here; adding a mode adds
one line.
"""

from __future__ import annotations

from torch import Tensor

from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.tensor import mode_1d, mode_2d, mode_3d, none, sequence
from gridtrain.parallel.tensor.spec import TensorMode

MODES: dict[str | None, TensorMode] = {
    None: none.MODE,
    "1d": mode_1d.MODE,
    "2d": mode_2d.MODE_2D,
    "2.5d": mode_2d.MODE_2P5D,
    "3d": mode_3d.MODE,
    "sequence": sequence.MODE,
}


def mode_spec(name: str | None) -> TensorMode:
    """The spec of the tensor mode ``name`` (None: no tensor mode)."""
    if name not in MODES:
        allowed = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"parallel.tensor.mode must be one of {allowed}; got {name!r}")
    return MODES[name]


def spec_of(ctx: ParallelContext | None = None) -> TensorMode:
    """The spec of ``ctx``'s tensor mode (else the current context's; with no context at
    all, the no-tensor mode's)."""
    if ctx is None and not has_context():
        return MODES[None]
    return mode_spec((ctx or get_context()).tensor_mode)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's part of a batch tensor under ``ctx``'s tensor mode (the engine calls this)."""
    return spec_of(ctx).split_batch(x, ctx)
