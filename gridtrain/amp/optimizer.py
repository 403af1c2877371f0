"""The interface the engine drives every mixed-precision optimizer through."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer


class AmpOptimizer:
    """Wraps a torch optimizer; the engine calls, once per optimizer step window:

    ``backward(loss)`` (every micro-step), then ``unscale_and_check() -> overflow``
    (same answer on every rank), optionally clipping of ``grad_params()``, then
    ``step()`` unless it overflowed, then ``update_scale(overflow)``.
    ``param_groups``/``state``/``state_dict`` are the wrapped optimizer's, so LR
    schedulers built on it keep working.
    """

    scaler: Any = None

    def __init__(self, optim: Optimizer):
        self.optim = optim

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def backward(self, loss: Tensor) -> None:
        self.scale_loss(loss).backward()

    def unscale_and_check(self) -> bool:
        """Unscale the gradients; True when any rank's gradients overflowed."""
        return False

    def grad_params(self) -> list[Tensor]:
        """Parameters whose ``.grad`` holds the unscaled gradients to clip and step on."""
        return [p for g in self.optim.param_groups for p in g["params"]]

    def step(self) -> None:
        self.optim.step()

    def update_scale(self, overflow: bool) -> None:
        pass

    def model_param_for(self, param: Tensor) -> Tensor:
        """The model parameter an optimizer parameter stands for (itself unless master weights)."""
        return param

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"
