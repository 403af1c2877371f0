"""The dynamic loss scaler of naive fp16 training (Megatron's rules, with hysteresis)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("gridtrain")


class DynamicLossScaler:
    """Multiply the loss by ``scale``; shrink it on overflow, grow it after a run of good steps.

    An overflow costs one unit of ``hysteresis``; when none is left the scale is
    multiplied by ``backoff_factor`` (not below ``min_scale``). After
    ``growth_interval`` consecutive good steps the scale is multiplied by
    ``growth_factor`` (not above ``max_scale``) and the hysteresis refills. Every
    rank must see the same overflow flags, so the scale stays identical everywhere.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
        verbose: bool = False,
    ):
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"fp16.initial_scale {initial_scale} must lie in [min_scale {min_scale}, "
                f"max_scale {max_scale}]"
            )
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        self.verbose = verbose
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that did (``overflow``) or did not overflow."""
        old = self.scale
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, self.max_scale)
        if self.verbose and self.scale != old:
            logger.info("loss scale %g -> %g", old, self.scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
