"""Strictness and the bounds every number of a config is held to.

Strict mode converts nothing silently (``True`` is not ``1``, ``"1.0"`` is not ``1.0``,
``2.0`` is not ``2``); an int is still accepted where a float is expected, and inf and nan
are refused everywhere.

Every number is bounded by what consumes it, so an absurd value fails at load time, naming
its key, rather than in every worker: c10d ranks and torch's split/chunk counts are 32-bit;
``torch.manual_seed`` takes 64 bits (and the per-mode generators add small offsets to the
seed); c10d keeps a timeout as int64 nanoseconds from now; a loss scale lives in an fp32
tensor.
"""

from typing import Annotated

from pydantic import ConfigDict, Field

STRICT = ConfigDict(strict=True, allow_inf_nan=False, validate_assignment=True)

MAX_COUNT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TIMEOUT_S = 1e9  # about 31 years
MAX_LOSS_SCALE = 3.4028234663852886e38  # float32's largest finite value
MAX_MB = float(2**20)  # one terabyte, for buffer sizes in MB

Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
NonNegativeCount = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Megabytes = Annotated[float, Field(gt=0, le=MAX_MB)]
LossScale = Annotated[float, Field(gt=0, le=MAX_LOSS_SCALE)]
