"""The 3D cube (Bian et al. 2021): axes, orientation, batch split and the Linear's algorithm.

The tensor group is a d x d x d cube, tensor rank ``t = k*d*d + j*d + i``. Its
three axes keep the names of their groups:

* INPUT (``PARALLEL_3D_INPUT``, i varies): the batch is cut into d blocks along
  it, and weights are all-gathered over it;
* WEIGHT (j) and OUTPUT (k): the two feature axes. An activation
  ``[batch, ..., hidden]`` has its hidden dim split over one of them, the
  *hidden axis*, and its batch block split again over the other, the *row
  axis*: rank (i, hidden h, row r) holds rows ``i*d + r`` of ``d*d`` and hidden block h.

A Linear all-gathers its input over the row axis (the whole batch block i), its
weight ``W[in block h, out block r]`` over INPUT, multiplies, and
reduce-scatters the partial products over the hidden axis along the batch: the
output's hidden dim is split over the old row axis and its rows over the old
hidden axis, so the two swap. Activations therefore come in two
*orientations*: 0 (hidden axis WEIGHT, row axis OUTPUT: what ``split_batch``
gives) and 1 (hidden axis OUTPUT, row axis WEIGHT). Which orientation a layer
sees is read off the model's data flow by the planner (``plan.py``): a Linear
flips it, everything else keeps it, embeddings start at 0. Embeddings and
classifiers compute in orientation 0 and convert (``swap_orientation``) when
their input or output is at 1.

The ranks that hold one hidden block of an activation are the *pair* group,
INPUT x row axis (``INPUT_X_OUTPUT`` at orientation 0, ``INPUT_X_WEIGHT`` at 1):
parameters every one of them uses (biases, norms) are split over the pair too,
so every rank holds 1/d^3 of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.mode_3d.geometry import cube_side  # noqa: F401 (estimate reads it here)

INPUT, WEIGHT, OUTPUT = PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT
PAIR = {WEIGHT: PM.PARALLEL_3D_INPUT_X_WEIGHT, OUTPUT: PM.PARALLEL_3D_INPUT_X_OUTPUT}


@dataclass(frozen=True, eq=False)
class Cube:
    """This rank's place in the d x d x d cube, seen in one orientation (0 or 1)."""

    ctx: ParallelContext
    d: int
    orientation: int
    hidden_axis: PM  # splits the hidden dim
    row_axis: PM  # splits the batch block again

    @classmethod
    def of(cls, ctx: ParallelContext | None = None, orientation: int = 0) -> Cube:
        ctx = ctx or get_context()
        if ctx.tensor_mode != "3d":
            raise ValueError(f"3D layers need tensor mode '3d', got {ctx.tensor_mode!r}")
        if orientation not in (0, 1):
            raise ValueError(f"3D orientation must be 0 or 1, got {orientation!r}")
        hidden, row = (WEIGHT, OUTPUT) if orientation == 0 else (OUTPUT, WEIGHT)
        return cls(ctx, ctx.world_size(INPUT), orientation, hidden, row)

    def flipped(self) -> Cube:
        return Cube.of(self.ctx, 1 - self.orientation)

    @property
    def pair(self) -> PM:
        """INPUT x row axis: every rank that holds one hidden block of an activation."""
        return PAIR[self.row_axis]

    def group(self, mode: PM):
        return self.ctx.group(mode)

    def rank(self, mode: PM) -> int:
        return self.ctx.local_rank(mode)

    def __deepcopy__(self, memo) -> Cube:
        return self  # process groups are shared handles

    def __repr__(self) -> str:
        return f"Cube({self.d}^3, orientation {self.orientation})"


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's rows of a batch ``[B, ...]``: block i of d over INPUT, then block k of d
    over OUTPUT (the row layout of orientation 0). Inputs and labels both pass through it."""
    cube = Cube.of(ctx)
    if x.dim() == 0 or x.shape[0] % cube.d**2:
        raise ValueError(
            f"split_batch: batch size {tuple(x.shape)[:1]} must be divisible by d*d = "
            f"{cube.d**2} under tensor mode '3d'"
        )
    x = x.chunk(cube.d, dim=0)[cube.rank(INPUT)]
    return x.chunk(cube.d, dim=0)[cube.rank(OUTPUT)]


def swap_orientation(x: Tensor, cube: Cube) -> Tensor:
    """Re-lay an activation of ``cube``'s orientation into the other one (rows and hidden swap).

    Gathers the batch block (over the row axis, then the hidden dim over the hidden
    axis) and keeps the other orientation's piece. Gather-forward/split-backward then
    split-forward/gather-backward: the gathered tensor is used identically by the
    group, so each rank keeps its slice of the (replicated) gradient.
    """
    if cube.d == 1:
        return x
    x = comm.gather_from_group(x, 0, cube.group(cube.row_axis))
    x = comm.gather_from_group(x, -1, cube.group(cube.hidden_axis))
    x = comm.split_to_group(x, 0, cube.group(cube.hidden_axis))
    return comm.split_to_group(x, -1, cube.group(cube.row_axis))


def hidden_spec(dim: int, cube: Cube):
    """Split ``dim`` over the hidden axis, then over the pair that shares that block."""
    return ((dim, cube.hidden_axis), (dim, cube.pair))


def as_shard(layer: str, x: Tensor, width: int, cube: Cube) -> Tensor:
    """``x`` with its hidden dim this rank's block; a full-width input (raw features after
    ``split_batch``, orientation 0 only) is cut here."""
    if cube.d > 1 and x.shape[-1] == width:
        if cube.orientation != 0:
            raise ValueError(
                f"{layer}: full-width input (last dim {width}) at orientation 1; only the "
                "layers before the first Linear (orientation 0) may take split_batch's output"
            )
        x = comm.split_to_group(x, -1, cube.group(cube.hidden_axis))
    if x.shape[-1] != width // cube.d:
        raise ValueError(
            f"{layer}: input's last dim is {x.shape[-1]}, expected {width} or this rank's "
            f"hidden block of {width // cube.d}"
        )
    return x


def linear_3d(
    x: Tensor, weight: Tensor, bias: Tensor | None, cube: Cube, transposed: bool = False
) -> Tensor:
    """The paper's ``Y = X W`` on rows (i, r) x hidden h -> rows (i, h) x hidden r.

    ``weight`` is nn.Linear's ``[out, in]`` block, or ``[in, out]`` when ``transposed``.
    """
    x = comm.all_gather(x, 0, cube.group(cube.row_axis))  # the whole batch block i
    w = comm.all_gather(weight, 1 if transposed else 0, cube.group(INPUT))
    y = F.linear(x, w.t() if transposed else w)
    y = comm.reduce_scatter(y, 0, cube.group(cube.hidden_axis))  # sum over in blocks
    if bias is not None:
        y = y + comm.all_gather(bias, 0, cube.group(PAIR[cube.hidden_axis]))
    return y
