"""``fp16``: mixed precision (the ``AMP_TYPE`` modes) and the dynamic loss scaler.

``AMP_TYPE`` is defined here, at the config level, so the schema validates a mode without
importing the packages that implement it (``gridtrain.amp`` re-exports it for configs).
"""

from __future__ import annotations

import importlib.util
from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from gridtrain.config.limits import Count, LossScale, NonNegativeCount
from gridtrain.config.section import Section


class AMP_TYPE(str, Enum):  # noqa: N801 - the legacy spelling users write in configs
    """Mixed-precision mode for ``fp16 = dict(mode=...)``."""

    TORCH = "torch"  # autocast fp16 + GradScaler
    NAIVE = "naive"  # fp16 model, fp32 master weights, dynamic loss scaler
    APEX = "apex"  # NVIDIA apex O-levels when installed
    BF16 = "bf16"  # autocast bf16, no scaler


class Fp16Config(Section):
    """``fp16``: mixed precision and the dynamic loss scaler."""

    # not strict: the strings "torch", "naive", ... (YAML) are the enum's values
    mode: AMP_TYPE | None = Field(None, strict=False, description="torch, naive, apex or bf16")
    initial_scale: LossScale = Field(2.0**16, description="first loss scale")
    growth_factor: float = Field(
        2.0, gt=1, description="scale multiplier after growth_interval good steps"
    )
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="scale multiplier on overflow")
    growth_interval: Count = Field(1000, description="good steps before the scale grows")
    hysteresis: Count = Field(2, description="naive: overflows tolerated before backing off")
    min_scale: LossScale = Field(
        1.0, description="smallest loss scale (torch and naive): it never backs off below"
    )
    max_scale: LossScale = Field(2.0**32, description="largest loss scale (torch and naive)")
    max_skipped_steps: NonNegativeCount = Field(
        64,
        description="torch and naive: optimizer steps skipped in a row for overflowing "
        "gradients before training stops with NonFiniteLossError; 0 = never stop",
    )
    verbose: bool = Field(False, description="log scale changes")
    opt_level: Literal["O0", "O1", "O2", "O3"] = Field("O1", description="apex only")

    @model_validator(mode="after")
    def _apex_installed(self) -> Fp16Config:
        if self.mode is AMP_TYPE.APEX and importlib.util.find_spec("apex") is None:
            raise ValueError(  # the same words as amp.apex_amp, which checks again
                "fp16 mode 'apex' needs NVIDIA apex, which is not installed; use "
                "fp16=dict(mode=AMP_TYPE.TORCH) (autocast + GradScaler), AMP_TYPE.NAIVE "
                "(fp16 model, fp32 master weights) or AMP_TYPE.BF16"
            )
        return self
