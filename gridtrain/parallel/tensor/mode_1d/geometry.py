"""1d's geometry (``tensor/geometry.py``): one group, PARALLEL_1D, over the whole tensor block;
attention heads split over it; Linears split column- or row-wise, activations whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.geometry import BlockGroups, ModeGeometry
from gridtrain.parallel.tensor.mode_1d import costs


@dataclass(frozen=True)
class Geometry1D(ModeGeometry):
    name: str | None = "1d"
    runtime: str = "gridtrain.parallel.tensor.mode_1d.runtime:MODE"
    vocab_parallel_loss: bool = True

    def groups(self, size: int, depth: int) -> BlockGroups:
        return {ParallelMode.PARALLEL_1D: [list(range(size))]}

    def head_split(self, size: int, depth: int) -> tuple[int, str]:
        return size, f"PARALLEL_1D ({size} ranks)"

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        return (1,) if heads % size == 0 else ()

    def in_width(self, g: Any, width: int, role: str) -> float:
        return width / g.size if role == "row" else width

    def out_width(self, g: Any, width: int, role: str) -> float:
        return width / g.size if role == "column" else width

    def layer_collectives(self, c: Any, name: str, entry: Any) -> None:
        costs.layer(c, name, entry)

    def loss_collectives(self, c: Any) -> None:
        costs.loss(c)


GEOMETRY = Geometry1D()
