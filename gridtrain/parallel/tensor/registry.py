"""The runtime half of the tensor modes: config name -> ``TensorMode`` (layers, loss, forward
context), found through the mode's geometry (``modes.py``, where modes are registered).

The engine splits batches, ``gt.nn`` picks its loss and accuracy, the planner and
``gridtrain estimate`` plan layers through the spec found here.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import geometry_of
from gridtrain.parallel.tensor.spec import TensorMode

_RUNTIMES: dict[str, TensorMode] = {}  # a plain dict: compiled forwards read it (dynamo
# warns on, and traces through, a functools cache)


def _runtime(geometry: ModeGeometry) -> TensorMode:
    spec = _RUNTIMES.get(geometry.runtime)
    if spec is None:
        module, _, attribute = geometry.runtime.partition(":")
        spec = _RUNTIMES[geometry.runtime] = getattr(importlib.import_module(module), attribute)
    return spec


def mode_spec(name: str | None) -> TensorMode:
    """The spec of the tensor mode ``name`` (None: no tensor mode)."""
    return _runtime(geometry_of(name))


def spec_of(ctx: ParallelContext | None = None) -> TensorMode:
    """The spec of ``ctx``'s tensor mode (else the current context's; with no context at
    all, the no-tensor mode's)."""
    if ctx is None and not has_context():
        return mode_spec(None)
    return mode_spec((ctx or get_context()).tensor_mode)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's part of a batch tensor under ``ctx``'s tensor mode (the engine calls this)."""
    return spec_of(ctx).split_batch(x, ctx)
