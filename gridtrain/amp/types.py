"""Names of the mixed-precision modes a config can ask for."""

from enum import Enum


class AMP_TYPE(str, Enum):  # noqa: N801 - the legacy spelling users write in configs
    """Mixed-precision mode for ``fp16 = dict(mode=...)``."""

    TORCH = "torch"  # autocast fp16 + GradScaler
    NAIVE = "naive"  # fp16 model, fp32 master weights, dynamic loss scaler
    APEX = "apex"  # NVIDIA apex O-levels when installed
    BF16 = "bf16"  # autocast bf16, no scaler
