"""``activation_checkpoint``: recompute blocks' activations in the backward instead of
keeping them (``gridtrain.engine.recompute``)."""

from pydantic import Field

from gridtrain.config.limits import Count
from gridtrain.config.section import SwitchSection


class ActivationCheckpointConfig(SwitchSection):
    """``activation_checkpoint``: recompute blocks' activations in the backward
    (``gridtrain.engine.recompute``); ``True`` takes the defaults."""

    every: Count = Field(
        1,
        description="checkpoint every n-th block of the model's block list (1: all, full "
        "recompute)",
    )
