"""``parallel``: how the world is cut into pipeline stages and tensor groups; the
data-parallel size is what is left (world / (pipeline x tensor))."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gridtrain.config.pipeline import PipelineConfig
from gridtrain.config.section import Section
from gridtrain.config.tensor import TensorConfig


class ParallelConfig(Section):
    """``parallel``: how the world is cut. The data-parallel size is derived."""

    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="pipeline stages (an int is the size); see PipelineConfig",
    )
    tensor: TensorConfig = Field(
        default_factory=TensorConfig,
        description="tensor parallelism within each replica (an int is the size); see TensorConfig",
    )

    @field_validator("pipeline", "tensor", mode="before")
    @classmethod
    def _int_is_size(cls, value: Any) -> Any:
        return {"size": value} if isinstance(value, int) and not isinstance(value, bool) else value
