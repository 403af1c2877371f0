"""``parallel.pipeline``: the pipeline stages, how the model is cut into them, and what the
schedule needs from the other keys."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gridtrain.config.limits import Count
from gridtrain.config.section import Section


class PipelineConfig(Section):
    """``parallel.pipeline``: an int (the size) or a dict with these keys."""

    size: Count = Field(1, description="number of pipeline stages")
    num_chunks: Count = Field(
        1, description="model chunks per stage; > 1 selects the interleaved 1F1B schedule"
    )
    partition: Literal["balanced", "parameters", "uniform"] = Field(
        "balanced", description="balance stages by parameters and compute, parameters, or layers"
    )
    tensor_shape: Annotated[tuple[Count, ...], Field(min_length=1)] | None = Field(
        None, description="fixed activation shape between stages; None exchanges shapes"
    )

    @field_validator("tensor_shape", mode="before")
    @classmethod
    def _list_is_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # YAML has no tuples

    def check_microbatches(self, num_microbatches: int | None) -> None:
        """The interleaved schedule runs micro-batches in rounds of one per stage, so it needs
        their number divisible by the pipeline size; raises ``ValueError`` otherwise."""
        m = num_microbatches
        if self.num_chunks > 1 and m is not None and m % self.size:
            raise ValueError(  # the same words as engine.schedules.check_interleaved
                f"the interleaved schedule (parallel.pipeline.num_chunks={self.num_chunks}) "
                "needs num_microbatches divisible by the pipeline size: num_microbatches "
                f"{m} % pipeline {self.size} != 0"
            )
