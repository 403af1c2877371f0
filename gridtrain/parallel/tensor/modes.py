"""Per tensor mode, the functions the engine and ``gt.nn`` dispatch to: ``split_batch``,
``CrossEntropyLoss`` and ``accuracy`` (one module per mode exports the three)."""

from __future__ import annotations

import importlib
from types import ModuleType

from gridtrain.parallel.context import ParallelContext, get_context, has_context

MODE_MODULES = {
    None: "gridtrain.parallel.tensor.dense",
    "1d": "gridtrain.parallel.tensor.mode_1d",
    "2d": "gridtrain.parallel.tensor.mode_2d",
    "2.5d": "gridtrain.parallel.tensor.mode_2d",
    "3d": "gridtrain.parallel.tensor.mode_3d",
    "sequence": "gridtrain.parallel.tensor.sequence",
}


def mode_module(ctx: ParallelContext | None = None) -> ModuleType:
    """The module of ``ctx``'s tensor mode (the dense one when there is no context)."""
    if ctx is None and not has_context():
        return importlib.import_module(MODE_MODULES[None])
    return importlib.import_module(MODE_MODULES[(ctx or get_context()).tensor_mode])


def split_batch(x, ctx: ParallelContext):
    """This rank's part of a batch tensor under ``ctx``'s tensor mode (the engine calls this)."""
    return mode_module(ctx).split_batch(x, ctx)
