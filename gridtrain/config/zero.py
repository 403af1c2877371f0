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

    keep_unsharded_grads: bool = Field(
        False,
        description="stage 3 (FSDP2): keep each rank's full unsharded gradients across "
        "accumulation micro-steps and pipeline micro-batches and reduce-scatter them once, in "
        "the window's last backward (1/micro-steps the reduce-scatter traffic; each rank then "
        "holds its whole stage's gradient, in the compute dtype, between micro-steps). "
        "False: reduce-scatter in every backward into fp32 shards, 1/dp of the gradient held",
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
        if self.keep_unsharded_grads and (self.stage != 3 or self.offload):
            raise ValueError(
                "zero.keep_unsharded_grads applies to stage 3 without offload (FSDP2), got "
                f"stage {self.stage}, offload {self.offload}; stage 1 is the stage that keeps "
                "full gradients and reduces them once per step"
            )
        return self
