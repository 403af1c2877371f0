"""The gradient-handler interface: something run on every rank after backward, before step."""

from __future__ import annotations

from torch import nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sync.base import GradSync


class GradientHandler(GradSync):
    """Built by the engine from ``gradient_handler = [dict(type=Name, **kwargs)]``.

    A gradient sync (``parallel.sync.GradSync``) that acts once the window's backwards are
    done: ``finish()`` is ``handle_gradient()``.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, **kwargs):
        self.model = model
        self.ctx = ctx

    def handle_gradient(self) -> None:
        """Synchronise ``.grad`` of the model's parameters across the handler's groups."""
        raise NotImplementedError

    def finish(self) -> None:
        self.handle_gradient()
