"""How one tensor rank holds a micro-batch's activations, per mode: each mode's geometry says
(``parallel/tensor/<mode>/geometry.py``, read off its layers), this class holds the sizes.

* none: everything whole.
* 1d (Megatron, ``mode_1d``): tokens and the residual stream whole on every rank;
  a column Linear's output and a row Linear's input are split ``T`` ways.
* 2d / 2.5d (``mode_2d``, rank (k, i, j)): rows cut into ``depth x q`` batch blocks
  (``split_batch``), every activation's hidden dim into ``q`` column blocks.
* 3d (``mode_3d``, ``d^3`` cube): rows into ``d^2`` blocks, hidden into ``d``; a Linear
  all-gathers its input over the row axis, so what it saves has ``d``x the rows.
* sequence (``sequence``): the sequence cut ``N`` ways, widths whole.

Widths: ``in_width``/``out_width`` of a Linear of role ``"column"`` (qkv, fc, the
head) or ``"row"`` (proj, fc2) on one rank.
"""

from __future__ import annotations

import dataclasses

from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import geometry_of


@dataclasses.dataclass(frozen=True)
class Geometry:
    mode: str | None
    size: int  # tensor group size T
    side: int  # 1d/sequence: T; 2d/2.5d: q; 3d: d; none: 1
    depth: int  # 2.5d depth (1 otherwise)

    @classmethod
    def of(cls, mode: str | None, size: int, depth: int = 1) -> Geometry:
        rules = geometry_of(mode)
        return cls(mode, size, rules.side(size, depth), depth if rules.uses_depth else 1)

    @property
    def rules(self) -> ModeGeometry:
        """The mode's own geometry: its cost formulas."""
        return geometry_of(self.mode)

    @property
    def grid(self) -> bool:
        return self.rules.blocked

    @property
    def row_blocks(self) -> int:
        """Batch blocks of one tensor group (``split_batch``)."""
        return self.rules.row_blocks(self)

    @property
    def seq_parts(self) -> int:
        return self.rules.seq_parts(self)

    @property
    def hidden_parts(self) -> int:
        """Split of the residual stream's hidden dim."""
        return self.rules.hidden_parts(self)

    @property
    def head_parts(self) -> int:
        """Ways attention heads are split (the mode's ``head_split``)."""
        return self.rules.head_split(self.size, self.depth)[0]

    @property
    def gather(self) -> int:
        """How many times more rows a Linear saves than the rank's block (3d's input gather)."""
        return self.rules.gather(self)

    def tokens(self, m: int) -> float:
        """Tokens of a ``m``-token micro-batch on one rank's activation blocks."""
        return m / (self.row_blocks * self.seq_parts)

    def in_width(self, width: int, role: str) -> float:
        return self.rules.in_width(self, width, role)

    def out_width(self, width: int, role: str) -> float:
        return self.rules.out_width(self, width, role)
