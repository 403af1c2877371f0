"""``parallel.tensor``: how each model replica's layers are split, and the plan styles a
config may name.

The styles are the planner's own objects (``gridtrain.parallel.tensor.style``, torch-free),
read here by name, so the schema validates a plan without importing the planner. The mode
names and each mode's size rules are the modes' own: their torch-free geometry, registered in
``gridtrain.parallel.tensor.modes``, which the section reads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gridtrain.config.errors import quote, unknown
from gridtrain.config.limits import Count
from gridtrain.config.section import Section
from gridtrain.parallel.tensor import style
from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import geometry_of, mode_names, names_where

TENSOR_MODES = mode_names()  # the built-in modes; ``modes.register_mode`` adds others

# the styles a plan may name, name -> what each does: read live from their one definition
# (``gridtrain.parallel.tensor.style``), so a registered style is accepted too
STYLES = style.STYLES


class TensorConfig(Section):
    """``parallel.tensor``: how each model replica's layers are split."""

    size: Count = Field(1, description="processes in one tensor-parallel group")
    mode: str | None = Field(
        None, description="tensor-parallel algorithm; None means no tensor parallelism"
    )
    depth: Count = Field(1, description="2.5d only: number of q x q layers")
    ring_attention: Literal["standard", "online"] = Field(
        "standard",
        description="sequence only: 'standard' keeps S x S/N scores, 'online' uses online softmax",
    )
    plan: dict[str, str] | None = Field(
        None,
        description="module-name pattern -> style (gridtrain.config.STYLES); "
        "None: the model's own plan or one traced from the data flow",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, mode: Any) -> Any:
        """A registered mode's name (refused in pydantic's words for a fixed choice)."""
        names = mode_names()
        if mode is not None and (not isinstance(mode, str) or mode not in names):
            expected = " or ".join([", ".join(repr(n) for n in names[:-1]), repr(names[-1])])
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            )
        return mode

    @property
    def geometry(self) -> ModeGeometry:
        """The mode's torch-free geometry (``gridtrain.parallel.tensor.geometry``)."""
        return geometry_of(self.mode)

    @field_validator("plan")
    @classmethod
    def _known_styles(cls, plan: dict[str, str] | None) -> dict[str, str] | None:
        for pattern, name in (plan or {}).items():
            if not pattern:
                raise ValueError("a plan pattern must not be empty")
            if name not in STYLES:
                what = f"plan pattern {quote(pattern)} names unknown style"
                raise ValueError(unknown(what, name, STYLES))
        return plan

    @model_validator(mode="after")
    def _layout(self) -> TensorConfig:
        """The sizes each mode's grid needs, checked before any process group exists."""
        size, mode, depth, geometry = self.size, self.mode, self.depth, self.geometry
        if mode is None and size > 1:
            raise ValueError(f"tensor size {size} needs a mode, one of {', '.join(mode_names())}")
        if depth != 1 and not geometry.uses_depth:
            users = names_where(lambda g: g.uses_depth)
            raise ValueError(
                f"tensor depth {depth} is only used by mode {users}, got mode {mode!r}"
            )
        if "ring_attention" in self.model_fields_set and not geometry.splits_sequence:
            users = names_where(lambda g: g.splits_sequence)
            raise ValueError(
                f"ring_attention={self.ring_attention!r} is only used by mode {users}, "
                f"got mode {mode!r}; remove it or set mode={users}"
            )
        geometry.check(size, depth)
        return self
