"""``moe``: mixture of experts (``gridtrain.parallel.moe``)."""

from pydantic import Field

from gridtrain.config.limits import Count
from gridtrain.config.section import Section


class MoeConfig(Section):
    """``moe``: mixture of experts."""

    expert_parallel_size: Count = Field(
        1, description="data ranks across which one layer's experts are spread"
    )
