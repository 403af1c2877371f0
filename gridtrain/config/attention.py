"""``attention``: which fused kernels ``scaled_dot_product_attention`` may use inside the
engine's forwards (``gridtrain.engine.sdpa``). Unset, a Hopper or newer GPU puts cuDNN
first and every other device keeps torch's own order; ``False`` keeps torch's order."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gridtrain.config.section import Section

SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
HOPPER_ORDER = ["cudnn", "flash", "efficient", "math"]  # cuDNN's kernel is fastest on sm90+


class AttentionConfig(Section):
    """``attention``: which fused attention kernels ``scaled_dot_product_attention`` may use
    (``gridtrain.engine.sdpa``), in order of preference; unset, compute capability 9.0 or
    more gets ``HOPPER_ORDER``."""

    backends: list[Literal[SDPA_BACKENDS]] = Field(
        min_length=1,
        description=f"kernels to allow, first preferred, from {list(SDPA_BACKENDS)}; cuDNN "
        "first is fastest on Hopper",
    )
