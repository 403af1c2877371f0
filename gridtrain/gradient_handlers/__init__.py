"""Gradient handlers, named in config: ``gradient_handler = [dict(type=Name, **kwargs)]``.

``HANDLERS`` maps each config name to ``(module, class)``; modules are imported
on first use, so a handler's file may be absent until someone asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.gradient_handlers.data_parallel import DataParallelGradientHandler
from gridtrain.gradient_handlers.sequence_parallel import SequenceParallelGradientHandler

HANDLERS: dict[str, tuple[str, str]] = {
    "DataParallelGradientHandler": (
        "gridtrain.gradient_handlers.data_parallel",
        "DataParallelGradientHandler",
    ),
    "SequenceParallelGradientHandler": (
        "gridtrain.gradient_handlers.sequence_parallel",
        "SequenceParallelGradientHandler",
    ),
    "PipelineSharedModuleGradientHandler": (
        "gridtrain.gradient_handlers.pipeline_shared",
        "PipelineSharedModuleGradientHandler",
    ),
    "MoeGradientHandler": ("gridtrain.gradient_handlers.moe", "MoeGradientHandler"),
}

# handlers that themselves average gradients over the data-parallel groups; naming none of
# them leaves that to the engine's overlapped path
DATA_PARALLEL_HANDLERS = (
    "DataParallelGradientHandler",
    "SequenceParallelGradientHandler",
    "MoeGradientHandler",
)


def handler_class(name: str) -> type[GradientHandler]:
    """The class registered under config name ``name``."""
    if name not in HANDLERS:
        raise ValueError(
            f"unknown gradient handler {name!r} (allowed: {', '.join(sorted(HANDLERS))})"
        )
    module, cls = HANDLERS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise ImportError(
            f"gradient handler {name!r} is not available: {module} is missing"
        ) from None


def __getattr__(name: str) -> Any:
    # `from gridtrain.gradient_handlers import MoeGradientHandler` imports its module lazily
    if name in HANDLERS:
        return handler_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATA_PARALLEL_HANDLERS",
    "HANDLERS",
    "DataParallelGradientHandler",
    "GradientHandler",
    "MoeGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "SequenceParallelGradientHandler",
    "handler_class",
]
