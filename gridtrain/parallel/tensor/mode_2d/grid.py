"""SUMMA on a q x q grid: the block matmuls of Optimus (2D) and Tesseract (2.5D).

Rank (i, j) of the grid holds block (i, j) of every distributed matrix: i is
its grid row (its local rank in the *column* group), j its grid column (its
local rank in the *row* group). Activations ``[batch, hidden]`` are blocked
batch over rows and hidden over columns; a weight ``W[in, out]`` in over rows
and out over columns. SUMMA (van de Geijn & Watts; Optimus, Xu et al. 2021)
computes ``C = A B`` in q steps: in step k, A's column panel k is broadcast
along every grid row and B's row panel k down every grid column, and each rank
adds the product of the two blocks it received. Its transposed forms
(``A B^T``, ``A^T B``) broadcast one operand and reduce the partial products to
the owner of each output block; each form's backward is the other two, so only
the two operands are saved and the panels are re-broadcast in backward.

Tesseract (Wang et al. 2021) stacks ``depth`` such grids: the batch is split
over depth as well, weights are replicated over depth, and a weight's gradient
is the *sum* of the depth slices' gradients (each slice back-propagates the
loss of a different part of the same batch, already divided by the whole
batch's size). ``replicated`` does that sum. Depth 1 is exactly 2D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.mode_2d.geometry import (
    GEOMETRY_2D,
    GEOMETRY_2P5D,
    grid_side,  # noqa: F401 (estimate reads it here)
)

# the grid's (row, column, depth) groups by mode name
_MODES = {g.name: g.axes for g in (GEOMETRY_2D, GEOMETRY_2P5D)}


@dataclass(frozen=True, eq=False)
class SummaGrid:
    """This rank's place in the (depth x) q x q grid, and the groups SUMMA talks over."""

    ctx: ParallelContext
    q: int
    i: int  # grid row = batch block within a depth slice = local rank in the column group
    j: int  # grid column = hidden block = local rank in the row group
    depth: int
    k: int  # depth slice (0 under 2d)
    row_mode: PM
    col_mode: PM
    dep_mode: PM | None
    row_ranks: tuple[int, ...]  # global ranks of grid row i, by column
    col_ranks: tuple[int, ...]  # global ranks of grid column j, by row

    @classmethod
    def of(cls, ctx: ParallelContext) -> SummaGrid:
        """The grid of ``ctx``, whose tensor mode must be '2d' or '2.5d'."""
        if ctx.tensor_mode not in _MODES:
            raise ValueError(
                f"SUMMA layers need tensor mode '2d' or '2.5d', got {ctx.tensor_mode!r}"
            )
        row, col, dep = _MODES[ctx.tensor_mode]
        return cls(
            ctx=ctx,
            q=ctx.world_size(row),
            i=ctx.local_rank(col),
            j=ctx.local_rank(row),
            depth=ctx.world_size(dep) if dep else 1,
            k=ctx.local_rank(dep) if dep else 0,
            row_mode=row,
            col_mode=col,
            dep_mode=dep,
            row_ranks=ctx.ranks(row),
            col_ranks=ctx.ranks(col),
        )

    @property
    def row_group(self):
        return self.ctx.group(self.row_mode)

    @property
    def col_group(self):
        return self.ctx.group(self.col_mode)

    @property
    def batch_parts(self) -> int:
        """How many blocks the batch is cut into: depth x q."""
        return self.depth * self.q

    @property
    def batch_index(self) -> int:
        """This rank's batch block: depth slice first, then grid row (Tesseract's X_{k*q+i})."""
        return self.k * self.q + self.i

    def __deepcopy__(self, memo) -> SummaGrid:
        return self  # process groups are shared handles; a copied module uses the same grid

    def __repr__(self) -> str:
        shape = f"{self.depth}x{self.q}x{self.q}" if self.dep_mode else f"{self.q}x{self.q}"
        return f"SummaGrid({shape}, at k={self.k} i={self.i} j={self.j})"


# ---- parameters replicated over depth / split over both grid axes --------------------------
def replicated(param: Tensor, grid: SummaGrid) -> Tensor:
    """A weight used by every depth slice: identity forward, gradient summed over depth backward.

    Depth slices see different parts of one batch and the loss is already divided
    by the whole batch, so the slices' gradients add up (not average) to the
    dense gradient. No-op under 2d.
    """
    if grid.dep_mode is None or grid.depth == 1:
        return param
    return comm.copy_to_group(param, grid.ctx.group(grid.dep_mode))


def gather_col(param: Tensor, dim: int, grid: SummaGrid) -> Tensor:
    """The grid column's block of a parameter split over both axes (1/q^2 per rank).

    All-gather over the column forward; reduce-scatter backward sums the
    gradients of the column's different batch blocks (and ``replicated`` those
    of the depth slices).
    """
    return comm.all_gather(replicated(param, grid), dim, grid.col_group)


def grid_of(ctx: ParallelContext | None) -> SummaGrid:
    """The grid of ``ctx``, or of the current context."""
    return SummaGrid.of(ctx or get_context())


def both_axes(dim: int, g: SummaGrid, packed: int = 1):
    """Split ``dim`` over grid columns, then each column's block over grid rows (1/q^2)."""
    return ((dim, g.row_mode, packed), (dim, g.col_mode))


def check_width(layer: str, x: Tensor, width: int) -> None:
    """Raise where an input is not this rank's hidden block (before any collective)."""
    if x.shape[-1] != width:
        raise ValueError(
            f"{layer}: input's last dim is {x.shape[-1]}, expected this rank's hidden block of {width}"
        )


# ---- the three block products (non-differentiable; autograd wrappers below) ---------------
def _panel(x: Tensor, mine: bool, src: int, group) -> Tensor:
    """Broadcast ``x`` from global rank ``src``; other ranks pass a buffer of its shape.

    The source sends ``x.data``: the broadcast writes its buffer in place, which must
    not bump the version of a weight that autograd saved elsewhere (values are unchanged).
    """
    return comm.broadcast_(x.data if mine else torch.empty_like(x), src, group)


def _ab(a: Tensor, b: Tensor, g: SummaGrid) -> Tensor:
    """C_ij = sum_k A_ik B_kj (A panels along rows, B panels down columns)."""
    out = None
    for k in range(g.q):
        a_k = _panel(a, k == g.j, g.row_ranks[k], g.row_group)
        b_k = _panel(b, k == g.i, g.col_ranks[k], g.col_group)
        out = a_k @ b_k if out is None else out.add_(a_k @ b_k)
    return out


def _abt(a: Tensor, b: Tensor, g: SummaGrid) -> Tensor:
    """C_ik = sum_j A_ij B_kj^T: B panels down columns, partial products reduced along rows."""
    out = None
    for k in range(g.q):
        b_k = _panel(b, k == g.i, g.col_ranks[k], g.col_group)
        part = comm.reduce_(a @ b_k.t(), g.row_ranks[k], g.row_group)
        if k == g.j:
            out = part
    return out


def _atb(a: Tensor, b: Tensor, g: SummaGrid) -> Tensor:
    """C_kj = sum_i A_ik^T B_ij: A panels along rows, partial products reduced down columns."""
    out = None
    for k in range(g.q):
        a_k = _panel(a, k == g.j, g.row_ranks[k], g.row_group)
        part = comm.reduce_(a_k.t() @ b, g.col_ranks[k], g.col_group)
        if k == g.i:
            out = part
    return out


# each form's gradients are the other two forms: form -> (C, dA, dB) of (a, b, dC)
_FORMS = {
    "ab": (_ab, lambda a, b, dc, g: _abt(dc, b, g), lambda a, b, dc, g: _atb(a, dc, g)),
    "abt": (_abt, lambda a, b, dc, g: _ab(dc, b, g), lambda a, b, dc, g: _atb(dc, a, g)),
    "atb": (_atb, lambda a, b, dc, g: _abt(b, dc, g), lambda a, b, dc, g: _ab(a, dc, g)),
}


class _Summa(torch.autograd.Function):
    """One SUMMA form of ``_FORMS``; only the operands are saved, the panels re-broadcast.

    Forward runs with autocast off, its operands cast to the autocast dtype of *their*
    device (CPU or CUDA alike; torch's custom_fwd takes one device type); backward then
    runs in that dtype (the saved operands'), so the panels it multiplies agree.
    """

    @staticmethod
    def forward(fctx, a, b, grid, form):
        dev = a.device.type
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            a, b = a.to(dtype), b.to(dtype)
        fctx.save_for_backward(a, b)
        fctx.grid, fctx.form = grid, form
        with torch.autocast(dev, enabled=False):
            return _FORMS[form][0](a, b, grid)

    @staticmethod
    def backward(fctx, dc):
        a, b = fctx.saved_tensors
        _, grad_a, grad_b = _FORMS[fctx.form]
        dc = dc.to(a.dtype)
        with torch.autocast(dc.device.type, enabled=False):
            da = grad_a(a, b, dc, fctx.grid) if fctx.needs_input_grad[0] else None
            db = grad_b(a, b, dc, fctx.grid) if fctx.needs_input_grad[1] else None
        return da, db, None, None


def matmul_ab(a: Tensor, b: Tensor, grid: SummaGrid) -> Tensor:
    """SUMMA ``C = A B`` on 2-D blocks: this rank passes A_ij, B_ij and gets C_ij."""
    return _Summa.apply(a, b, grid, "ab")


def matmul_abt(a: Tensor, b: Tensor, grid: SummaGrid) -> Tensor:
    """SUMMA ``C = A B^T`` on 2-D blocks (B blocked like C^T's rows): this rank gets C_ij."""
    return _Summa.apply(a, b, grid, "abt")


def matmul_atb(a: Tensor, b: Tensor, grid: SummaGrid) -> Tensor:
    """SUMMA ``C = A^T B`` on 2-D blocks (a weight gradient ``X^T dY``): this rank gets C_ij."""
    return _Summa.apply(a, b, grid, "atb")
