"""The 3D cube (Bian et al. 2021): axes, layout orientation, batch split, the layers' building blocks.

The tensor group is a d x d x d cube, tensor rank ``t = k*d*d + j*d + i``. We
name its three axes by their role in the paper's ``Y = X W``:

* axis A (``PARALLEL_3D_INPUT``, i varies): the paper's first coordinate. The
  batch is cut into d blocks along it, and weights are all-gathered over it.
* axes B (``PARALLEL_3D_WEIGHT``, j) and C (``PARALLEL_3D_OUTPUT``, k): the two
  feature axes. An activation ``[batch, ..., hidden]`` has its hidden dim split
  over one of them (F) and its batch block split again over the other (G):
  rank (a, f, g) holds rows ``a*d + g`` of ``d*d`` and hidden block f.

A Linear all-gathers its input over G (the whole batch block a), its weight
``W[in block f, out block g]`` over A, multiplies, and reduce-scatters the
partial products over F along the batch: the output's hidden dim is split over
G and its rows over F, so F and G swap. Consecutive Linears therefore alternate
between *orientation 0* (F = B, G = C: what ``split_batch`` gives) and
*orientation 1* (F = C, G = B). Each layer takes the orientation current when
it is constructed (a per-context counter that every Linear flips), so build
layers in the order they are applied; a block with an even number of Linears on
every path (MLP, attention) keeps the residual stream in orientation 0.
Embeddings and classifiers always compute in orientation 0 and convert
(``swap_orientation``) when built at orientation 1.

The pair groups A x B (``INPUT_X_WEIGHT``) and A x C (``OUTPUT_X_WEIGHT``) are
the ranks that share one hidden block of an activation: parameters used by all
of them (biases, LayerNorm) are split over the pair too, so every rank holds 1/d^3.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.sharding import set_shard_spec, shard_tensor

AXIS_A, AXIS_B, AXIS_C = PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT
PAIR = {AXIS_B: PM.PARALLEL_3D_INPUT_X_WEIGHT, AXIS_C: PM.PARALLEL_3D_OUTPUT_X_WEIGHT}

_ORIENTATION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class Cube:
    """This rank's place in the d x d x d cube, seen in one orientation (0 or 1)."""

    ctx: ParallelContext
    d: int
    orientation: int
    feat: PM  # F: the axis that splits the hidden dim
    row: PM  # G: the axis that splits the batch block again

    @classmethod
    def of(cls, ctx: ParallelContext, orientation: int = 0) -> Cube:
        if ctx.tensor_mode != "3d":
            raise ValueError(f"3D layers need tensor mode '3d', got {ctx.tensor_mode!r}")
        feat, row = (AXIS_B, AXIS_C) if orientation == 0 else (AXIS_C, AXIS_B)
        return cls(ctx, ctx.world_size(AXIS_A), orientation, feat, row)

    def flipped(self) -> Cube:
        return Cube.of(self.ctx, 1 - self.orientation)

    @property
    def pair(self) -> PM:
        """A x G: every rank that holds hidden block f of an activation in this orientation."""
        return PAIR[self.row]

    def group(self, mode: PM):
        return self.ctx.group(mode)

    def rank(self, mode: PM) -> int:
        return self.ctx.local_rank(mode)

    def __deepcopy__(self, memo) -> Cube:
        return self  # process groups are shared handles

    def __repr__(self) -> str:
        return f"Cube({self.d}^3, orientation {self.orientation})"


def take_orientation(ctx: ParallelContext, flip: bool = False) -> int:
    """The orientation a layer built now gets; a Linear (``flip``) turns it for the next layer."""
    current = _ORIENTATION.get(ctx, 0)
    if flip:
        _ORIENTATION[ctx] = 1 - current
    return current


def reset_orientation(ctx: ParallelContext | None = None) -> None:
    """Start the next model's layers at orientation 0 (after building a model with an odd
    number of Linears, before building another in the same process)."""
    _ORIENTATION[ctx or get_context()] = 0


# ---- batch layout ---------------------------------------------------------------------------
def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """This rank's rows of a batch ``[B, ...]``: block a of d over A, then block c of d over C.

    That is the row layout of orientation 0; other dims stay whole (layers cut the
    hidden dim themselves). Inputs and labels both pass through it.
    """
    cube = Cube.of(ctx)
    if x.dim() == 0 or x.shape[0] % cube.d**2:
        raise ValueError(
            f"split_batch: batch size {tuple(x.shape)[:1]} must be divisible by d*d = "
            f"{cube.d**2} under tensor mode '3d'"
        )
    x = x.chunk(cube.d, dim=0)[cube.rank(AXIS_A)]
    return x.chunk(cube.d, dim=0)[cube.rank(AXIS_C)]


def swap_orientation(x: Tensor, cube: Cube) -> Tensor:
    """Re-lay an activation of ``cube``'s orientation into the other one (rows and hidden swap axes).

    Gathers the batch block a (over G, then the hidden dim over F) and keeps the
    other orientation's piece. Gather-forward/split-backward then
    split-forward/gather-backward: the gathered tensor is used identically by the
    group, so each rank keeps its slice of the (replicated) gradient.
    """
    if cube.d == 1:
        return x
    x = comm.gather_from_group(x, 0, cube.group(cube.row))
    x = comm.gather_from_group(x, -1, cube.group(cube.feat))
    x = comm.split_to_group(x, 0, cube.group(cube.feat))
    return comm.split_to_group(x, -1, cube.group(cube.row))


# ---- building blocks of the layers ----------------------------------------------------------
def cube_now(ctx: ParallelContext | None, flip: bool = False) -> Cube:
    """The cube in the orientation a layer built now gets (``ctx`` None: the current context)."""
    ctx = ctx or get_context()
    return Cube.of(ctx, take_orientation(ctx, flip))


def shard_param(full: Tensor, spec, cube: Cube, device=None) -> nn.Parameter:
    """This rank's shard of dense tensor ``full`` as a parameter tagged with ``spec``."""
    shard = shard_tensor(full.detach(), spec, cube.ctx)
    return set_shard_spec(nn.Parameter(shard.to(device or cube.ctx.device)), *spec)


def hidden_spec(dim: int, cube: Cube):
    """Split ``dim`` over the hidden axis F, then over the pair A x G that shares that block."""
    return ((dim, cube.feat), (dim, cube.pair))


def as_shard(layer: str, x: Tensor, width: int, cube: Cube) -> Tensor:
    """``x`` with its hidden dim this rank's block; a full-width input (raw features after
    ``split_batch``, orientation 0 only) is cut here."""
    if cube.d > 1 and x.shape[-1] == width:
        if cube.orientation != 0:
            raise ValueError(
                f"{layer}: full-width input (last dim {width}) at orientation 1; only the "
                "layers before the first Linear (orientation 0) may take split_batch's output"
            )
        x = comm.split_to_group(x, -1, cube.group(cube.feat))
    if x.shape[-1] != width // cube.d:
        raise ValueError(
            f"{layer}: input's last dim is {x.shape[-1]}, expected {width} or this rank's "
            f"hidden block of {width // cube.d}"
        )
    return x


def linear_3d(x: Tensor, weight: Tensor, bias: Tensor | None, cube: Cube) -> Tensor:
    """The paper's ``Y = X W`` on rows (a, g) x hidden f -> rows (a, f) x hidden g."""
    x = comm.all_gather(x, 0, cube.group(cube.row))  # the whole batch block a
    w = comm.all_gather(weight, 0, cube.group(AXIS_A))  # W[out block g, in block f]
    y = comm.reduce_scatter(F.linear(x, w), 0, cube.group(cube.feat))  # sum over in blocks
    if bias is not None:
        y = y + comm.all_gather(bias, 0, cube.group(PAIR[cube.feat]))
    return y
