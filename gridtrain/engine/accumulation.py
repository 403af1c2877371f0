"""Gradient accumulation: N micro-steps (backward passes) per optimizer step window."""

from __future__ import annotations

from torch import Tensor


class GradientAccumulation:
    """Counts the micro-steps of the current window.

    Each micro-step's loss is divided by ``size`` so the accumulated gradient is
    the mean over the window's micro-batches; the optimizer (and LR scheduler)
    step and the data-parallel sync happen once, at the window's end.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {size}")
        self.size = size
        self.micro_step = 0  # backward passes done in this window

    @property
    def at_window_start(self) -> bool:
        return self.micro_step == 0

    @property
    def window_complete(self) -> bool:
        return self.micro_step == self.size

    @property
    def in_last_micro_step(self) -> bool:
        """Whether the backward now running is the window's last (the one to sync on)."""
        return self.micro_step == self.size

    def begin_micro_step(self) -> None:
        if self.micro_step == self.size:
            raise RuntimeError(
                f"backward called {self.size + 1} times without engine.step() "
                f"(gradient_accumulation = {self.size}); call engine.step() after every backward"
            )
        self.micro_step += 1

    def scale(self, loss: Tensor) -> Tensor:
        return loss / self.size if self.size > 1 else loss

    def reset(self) -> None:
        self.micro_step = 0
