"""``parallel.tensor``: how each model replica's layers are split, and the plan styles a
config may name.

The styles are defined here, at the config level, so the schema validates a plan without
importing the planner that applies them (``gridtrain.parallel.tensor.plan`` reads
``STYLES``). The mode names and each mode's size rules are the modes' own: their torch-free
geometry, registered in ``gridtrain.parallel.tensor.modes``, which the section reads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gridtrain.config.errors import quote, unknown
from gridtrain.config.limits import Count
from gridtrain.config.section import Section
from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import geometry_of, mode_names, names_where

TENSOR_MODES = mode_names()  # the built-in modes; ``modes.register_mode`` adds others

# the layer styles a tensor-parallel plan may name (the Hugging Face ``tp_plan`` vocabulary,
# plus gridtrain's own), each with what it does
STYLES = {
    "colwise": "Linear: output features split (output stays sharded); on an Embedding: the "
    "embedding dim split",
    "rowwise": "Linear: input features split, partial products all-reduced (replicated output)",
    "colwise_gather_output": "Linear: output features split, then all-gathered (replicated output)",
    "rowwise_split_input": "Linear: row-parallel on a replicated input (each rank cuts its slice)",
    "packed_colwise": "Linear/Conv1D whose output packs several equal blocks (fused q/k/v, "
    "gate/up): each block split column-wise, so every rank keeps whole heads of each",
    "embedding_rowwise": "Embedding: vocabulary split, partial rows all-reduced",
    "embedding_colwise": "Embedding: embedding dim split, output all-gathered",
    "vocab_parallel": "output Linear (LM head, classifier): logits stay sharded over the "
    "classes; pair with gt.nn.CrossEntropyLoss",
    "gather_output": "output Linear (LM head, classifier): full logits on every rank "
    "(2d/2.5d/3d: the mode's Classifier)",
    "heads": "nn.MultiheadAttention: the packed in_proj cut into each rank's q, k and v heads, "
    "out_proj row-parallel (sequence: ring attention over the split positions)",
    "norm": "LayerNorm / RMSNorm over the last dim, in the mode's layout",
    "replicated_with_grad_allreduce": "a norm on activations split over the tensor group (a "
    "per-head q_norm after a column-parallel q_proj): its weight whole on every rank, its "
    "gradient summed over the group",
    "auto": "the mode's own layer (2d/2.5d/3d: every Linear is a SUMMA / cube Linear)",
    "replicate": "leave the module as it is (every rank holds it whole)",
}


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
        for pattern, style in (plan or {}).items():
            if not pattern:
                raise ValueError("a plan pattern must not be empty")
            if style not in STYLES:
                what = f"plan pattern {quote(pattern)} names unknown style"
                raise ValueError(unknown(what, style, STYLES))
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
