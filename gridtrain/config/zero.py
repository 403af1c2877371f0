"""``zero``: ZeRO sharding of optimizer state, gradients and parameters over each
parameter's data-parallel group (``gridtrain.parallel.zero``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gridtrain.config.limits import MAX_MB, Megabytes
from gridtrain.config.section import Section


class ZeroConfig(Section):
    """``zero``: ZeRO sharding over each parameter's data-parallel group
    (``gridtrain.parallel.zero``); an int is the stage."""

    stage: Literal[1, 2, 3] = Field(
        description="1: optimizer state (and fp32 masters), 2: also gradients, 3: also "
        "parameters (FSDP2)"
    )
    offload: bool = Field(
        False,
        description="keep optimizer state and fp32 masters in CPU memory and step there; at "
        "stage 3 (Gemini) the device keeps only compute-dtype parameters, where they fit",
    )
    bucket_size_mb: Megabytes = Field(
        25.0, description="stages 1-2: size of one reduce-scatter / all-gather bucket"
    )
    device_param_mb: Annotated[float, Field(ge=0, le=MAX_MB)] | None = Field(
        None,
        description="stage 3 offload: MiB of compute-dtype parameters kept on the device, "
        "chunk by chunk in forward order (the rest stream); None: 55% of the CUDA memory limit",
    )
    delayed_update: bool = Field(
        False,
        description="stage 3 offload: ZeRO-Offload's one-step delayed parameter update (the "
        "host step overlaps the next forward and backward; gradients are one step stale)",
    )

    @model_validator(mode="before")
    @classmethod
    def _int_is_stage(cls, data: Any) -> Any:
        return {"stage": data} if isinstance(data, int) and not isinstance(data, bool) else data

    @model_validator(mode="after")
    def _offload_keys(self) -> ZeroConfig:
        """Gemini's keys mean nothing elsewhere: refuse them rather than ignore them."""
        gemini = self.stage == 3 and self.offload
        for key in ("device_param_mb", "delayed_update"):
            if getattr(self, key) not in (None, False) and not gemini:
                raise ValueError(
                    f"zero.{key} applies to stage 3 with offload=True (Gemini), got stage "
                    f"{self.stage}, offload {self.offload}"
                )
        return self
