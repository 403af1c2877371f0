"""Which model library's adapter a model gets, chosen at the top of the stack.

An adapter (``parallel.tensor.plan.ModelAdapter``) gives the planner a library's
knowledge of its models: their tensor plans and head checks, the fixes their code
needs once sharded, their pipeline layers, the classes of their own layers that the planner
treats as its kinds. ``gridtrain.hf`` is the one for Hugging
Face ``transformers`` models. It is picked here and handed down through
``initialize``, so ``parallel/`` and ``engine/`` never import a library's support,
and ``transformers`` is imported only for its own models.
"""

from __future__ import annotations

import functools

from torch import nn

from gridtrain.engine.initialize import initialize as _initialize
from gridtrain.parallel.tensor.plan import ModelAdapter


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of the library ``model`` comes from: ``gridtrain.hf`` for a model whose
    class derives from a ``transformers`` class, else None."""
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        import gridtrain.hf

        return gridtrain.hf
    return None


def register_library_layers(model: nn.Module) -> None:
    """A plain PyTorch model may hold a library's layers (``transformers``' ``Conv1D``): that
    library's support hands them to the planner (``gridtrain.hf.layers``) on import."""
    if not isinstance(model, nn.Module):  # the engine's argument check names it
        return
    if any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        import gridtrain.hf  # noqa: F401 - its import registers them


@functools.wraps(_initialize)  # the engine's signature and docstring
def initialize(model: nn.Module, *args, adapter: ModelAdapter | None = None, **kwargs):
    # gt.initialize: the engine's, with the model's adapter picked here when none is given
    register_library_layers(model)
    if adapter is None:
        adapter = adapter_for(model)
    return _initialize(model, *args, adapter=adapter, **kwargs)
