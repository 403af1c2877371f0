"""Which model library's adapter a model gets, chosen at the top of the stack.

An adapter (``parallel.tensor.plan.ModelAdapter``) gives the planner a library's
knowledge of its models: their tensor plans and head checks, the fixes their code
needs once sharded, their pipeline layers. ``gridtrain.hf`` is the one for Hugging
Face ``transformers`` models. It is picked here and handed down through
``initialize``, so ``parallel/`` and ``engine/`` never import a library's support,
and ``transformers`` is imported only for its own models.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from gridtrain.engine.initialize import initialize as _initialize
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.plan import ModelAdapter


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of the library ``model`` comes from: ``gridtrain.hf`` for a model whose
    class derives from a ``transformers`` class, else None."""
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        import gridtrain.hf

        return gridtrain.hf
    return None


@functools.wraps(_initialize)
def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module | None = None,
    train_dataloader=None,
    test_dataloader=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
    example_inputs: Any = None,
    adapter: ModelAdapter | None = None,
):
    # gt.initialize: the engine's, with the model's adapter picked here when none is given
    return _initialize(
        model,
        optimizer,
        criterion,
        train_dataloader,
        test_dataloader,
        lr_scheduler,
        ctx=ctx,
        example_inputs=example_inputs,
        adapter=adapter if adapter is not None else adapter_for(model),
    )
