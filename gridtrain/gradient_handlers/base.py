"""The gradient-handler interface: something run on every rank after backward, before step."""

from __future__ import annotations

from torch import nn

from gridtrain.parallel.context import ParallelContext


class GradientHandler:
    """Built by the engine from ``gradient_handler = [dict(type=Name, **kwargs)]``."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, **kwargs):
        self.model = model
        self.ctx = ctx

    def handle_gradient(self) -> None:
        """Synchronise ``.grad`` of the model's parameters across the handler's groups."""
        raise NotImplementedError
