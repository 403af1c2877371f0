"""3d's geometry (``tensor/geometry.py``): a d x d x d cube.

Rank (i, j, k) is tensor rank ``k*d*d + j*d + i``; one group per axis (its coordinate
varies) and per pair of axes (both vary). The batch is cut into ``d^2`` row blocks, the
hidden dim into ``d``; a Linear all-gathers its input over the row axis; attention heads
are split over the hidden axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.geometry import BlockGroups, ModeGeometry
from gridtrain.parallel.tensor.mode_3d import costs


def cube_side(size: int) -> int:
    """d, the side of the d x d x d cube of ``size`` ranks."""
    return round(size ** (1 / 3))


def cube_groups(size: int, depth: int = 1) -> BlockGroups:
    """One tensor block's groups (module docstring)."""
    d = cube_side(size)
    r = range(d)

    def at(i: int, j: int, k: int) -> int:
        return k * d * d + j * d + i

    return {
        PM.PARALLEL_3D_INPUT: [[at(i, j, k) for i in r] for k, j in product(r, r)],
        PM.PARALLEL_3D_WEIGHT: [[at(i, j, k) for j in r] for k, i in product(r, r)],
        PM.PARALLEL_3D_OUTPUT: [[at(i, j, k) for k in r] for j, i in product(r, r)],
        PM.PARALLEL_3D_INPUT_X_WEIGHT: [[at(i, j, k) for j, i in product(r, r)] for k in r],
        PM.PARALLEL_3D_OUTPUT_X_WEIGHT: [[at(i, j, k) for k, j in product(r, r)] for i in r],
        PM.PARALLEL_3D_INPUT_X_OUTPUT: [[at(i, j, k) for k, i in product(r, r)] for j in r],
    }


@dataclass(frozen=True)
class CubeGeometry(ModeGeometry):
    name: str | None = "3d"
    runtime: str = "gridtrain.parallel.tensor.mode_3d.runtime:MODE"
    blocked: bool = True
    vocab_parallel_loss: bool = True

    def check(self, size: int, depth: int) -> None:
        if cube_side(size) ** 3 != size:
            raise ValueError(f"3d needs a cubic tensor size (1, 8, 27, ...), got {size}")

    def side(self, size: int, depth: int) -> int:
        return cube_side(size)

    def groups(self, size: int, depth: int) -> BlockGroups:
        return cube_groups(size)

    def head_split(self, size: int, depth: int) -> tuple[int, str]:
        d = cube_side(size)
        return d, f"the cube's hidden axis (d = {d})"

    def batch_split(self, size: int, depth: int) -> tuple[int, str]:
        d = cube_side(size)
        return d * d, f"d*d = {d * d} batch blocks of the cube"

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        d = cube_side(size)
        return (1,) if d**3 == size and heads % d == 0 else ()

    def row_blocks(self, g: Any) -> int:
        return g.side**2

    def hidden_parts(self, g: Any) -> int:
        return g.side

    def gather(self, g: Any) -> int:
        return g.side

    def saved_weights(self, g: Any) -> int:
        return g.side  # every all-gathered weight is kept for backward

    def layer_collectives(self, c: Any, name: str, entry: Any) -> None:
        costs.layer(c, name, entry)

    def loss_collectives(self, c: Any) -> None:
        costs.loss(c)


GEOMETRY = CubeGeometry()
