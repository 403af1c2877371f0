"""What a Hugging Face model needs before training that is not about its layers' shapes.

* Activation checkpointing recomputes each decoder layer in the backward. A model called
  with its config's ``use_cache=True`` (the default of the Llama family) appends each
  layer's keys and values to a cache in the forward, and the recompute appends them again
  (attention then sees twice the keys). ``transformers``' own gradient checkpointing turns
  the cache off in training; so does gridtrain: a training forward gets ``use_cache=False``
  unless the caller passes ``use_cache``, and an explicit ``use_cache=True`` is refused.
"""

from __future__ import annotations

import inspect

from torch import nn

from gridtrain.parallel.context import ParallelContext


def prepare_training(model: nn.Module, ctx: ParallelContext) -> None:
    """Install what ``ctx.config`` needs of ``model``'s forward (see the module doc)."""
    if ctx.config.activation_checkpoint is None:
        return
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return
    model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)


def _no_cache_in_training(module: nn.Module, args: tuple, kwargs: dict):
    if not module.training:
        return None
    if kwargs.get("use_cache"):
        raise ValueError(
            "activation_checkpoint: use_cache=True in a training forward would append every "
            "recomputed layer's keys and values to the cache a second time; leave it out "
            "(gridtrain trains without a cache) or call engine.eval() to generate"
        )
    return args, {**kwargs, "use_cache": False}
