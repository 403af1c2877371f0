"""``gradient_handler``: the handlers run after backward, by name, with their keyword
arguments checked at load time (``gridtrain.gradient_handlers`` implements them)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gridtrain.config.errors import did_you_mean, quote, unknown
from gridtrain.config.limits import MAX_MB, STRICT

# config name -> the keyword arguments its __init__ takes besides (model, ctx); kept here so a
# config is checked without importing the handlers (tests/test_config_strict.py compares this
# table with their signatures)
HANDLER_KWARGS: dict[str, tuple[str, ...]] = {
    "DataParallelGradientHandler": ("bucket_size_mb",),
    "SequenceParallelGradientHandler": ("bucket_size_mb",),
    "PipelineSharedModuleGradientHandler": (),
    "MoeGradientHandler": ("bucket_size_mb",),
}
GRADIENT_HANDLERS = tuple(HANDLER_KWARGS)


class GradientHandlerConfig(BaseModel):
    """One entry of ``gradient_handler``: ``dict(type=name, **kwargs)``."""

    # extra keys are the handler's keyword arguments, checked against HANDLER_KWARGS
    model_config = ConfigDict(**STRICT, extra="allow")
    type: str = Field(description=f"the handler's name, one of {', '.join(GRADIENT_HANDLERS)}")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in GRADIENT_HANDLERS:
            raise ValueError(unknown("unknown gradient handler", value, GRADIENT_HANDLERS))
        return value

    @model_validator(mode="after")
    def _known_kwargs(self) -> GradientHandlerConfig:
        allowed = HANDLER_KWARGS[self.type]
        for key, value in self.kwargs.items():
            if key not in allowed:
                takes = ", ".join(allowed) if allowed else "none"
                raise ValueError(
                    f"{self.type} got unknown keyword argument {quote(key)}"
                    f"{did_you_mean(key, allowed)} (it takes: {takes})"
                )
            if key == "bucket_size_mb" and not _is_megabytes(value):
                raise ValueError(
                    f"{self.type}: bucket_size_mb must be a number > 0 and <= {MAX_MB:.0f}, "
                    f"got {quote(value)}"
                )
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments given to the handler's constructor."""
        return dict(self.model_extra or {})


def _is_megabytes(value: Any) -> bool:
    """What ``limits.Megabytes`` allows, for a keyword argument pydantic does not type."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_MB
    )
