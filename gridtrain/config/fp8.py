"""``fp8``: float8 matmuls in the model's ``nn.Linear`` layers through torchao's float8
training (``gridtrain.amp.fp8``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gridtrain.config.limits import Count
from gridtrain.config.section import SwitchSection

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Fp8Config(SwitchSection):
    """``fp8``: float8 matmuls in the model's ``nn.Linear`` layers through torchao's float8
    training (``gridtrain.amp.fp8``); ``True`` takes the defaults. Off when absent."""

    recipe: Literal[FP8_RECIPES] = Field(
        "tensorwise",
        description=f"torchao scaling recipe, from {list(FP8_RECIPES)}: one scale per tensor "
        "(fastest), per row, or per row with the weight gradient in high precision",
    )
    skip: list[str] = Field(
        default_factory=lambda: ["*lm_head", "*output", "*head", "*gate", "*router"],
        description="fnmatch patterns of Linear names kept in high precision (the LM head's "
        "logits and an MoE router's scores are the most precision-sensitive; a head tied to "
        "an embedding is always kept)",
    )
    min_features: Count = Field(
        256, description="Linear layers with fewer input or output features stay high precision"
    )

    @staticmethod
    def check_with(tensor_mode: str | None, amp: str | None) -> None:
        """fp8 converts plain ``nn.Linear`` layers (a tensor mode replaces them with its own)
        and computes in bf16 or fp32 around the float8 matmuls; raises ``ValueError``
        for a tensor mode or an fp16 ``amp`` mode."""
        if tensor_mode is not None:
            raise ValueError(
                f"fp8 converts the model's nn.Linear layers; parallel.tensor.mode "
                f"{tensor_mode!r} replaces them with its own: use fp8 with "
                "data, pipeline or ZeRO parallelism (parallel.tensor.mode None)"
            )
        if amp is not None and str(amp) != "bf16":
            raise ValueError(
                f"fp8 runs under bf16 or fp32: fp16.mode must be 'bf16' or None, got {amp!r}"
            )
