"""Which rows of an activation a rank holds, and the masks that belong to them.

A tensor mode cuts one dim of every activation into blocks (2d/2.5d/3d: dim 0, the batch
of a ``batch_first`` input or the positions of a ``[L, B, E]`` one; sequence: dim 1).
``Rows`` says how: ``parts`` blocks, this rank's ``index``, and the groups whose all-gather,
innermost first, puts the blocks back in order. Attention over split positions gathers its
keys and values that way; masks, which a caller may pass whole, cut by the engine's batch
split, or built from the model's split input, are rebuilt whole (``whole_mask``) and then
cut to the rank's rows of the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError


@dataclass(frozen=True, eq=False)
class Rows:
    """Dim ``dim`` of an activation in ``parts`` blocks; this rank holds block ``index``;
    all-gathers over ``modes`` (innermost first) rebuild the whole dim in order."""

    ctx: object
    dim: int
    parts: int
    index: int
    modes: tuple[ParallelMode, ...]

    def gather(self, t: Tensor, dim: int) -> Tensor:
        """All blocks of ``t`` along ``dim``; the backward sums each block's gradient back to
        its owner (every rank uses the whole for its own rows). Shapes only on meta."""
        if t.is_meta:
            return t.new_empty(*t.shape[:dim], t.shape[dim] * self.parts, *t.shape[dim + 1 :])
        for mode in self.modes:
            t = comm.all_gather(t, dim, self.ctx.group(mode))
        return t

    def gather_raw(self, t: Tensor, dim: int) -> Tensor:
        """``gather`` without autograd (masks); booleans travel as bytes."""
        if t.requires_grad or t.is_meta:
            return self.gather(t, dim)
        boolean = t.dtype == torch.bool
        t = t.to(torch.uint8) if boolean else t
        for mode in self.modes:
            t = comm.all_gather_raw(t, dim, self.ctx.group(mode))
        return t.bool() if boolean else t

    def cut(self, t: Tensor, dim: int) -> Tensor:
        """This rank's block of the whole ``t`` along ``dim``."""
        return t.chunk(self.parts, dim=dim)[self.index]

    def __deepcopy__(self, memo) -> Rows:
        return self  # process groups are shared handles


def whole_mask(mask: Tensor, whole: tuple[int, ...], rows: Rows | None, name: str) -> Tensor:
    """``mask`` of the whole batch and sequence (``whole``): as given, or all-gathered along
    the one dim that ``rows`` cut (by the engine, or by the model from its split input)."""
    shape = tuple(mask.shape)
    if shape == whole:
        return mask
    accepted = [whole]
    if rows is not None and rows.parts > 1:
        for dim, size in enumerate(whole):
            if size % rows.parts == 0:
                cut = whole[:dim] + (size // rows.parts,) + whole[dim + 1 :]
                if shape == cut:
                    return rows.gather_raw(mask, dim)
                accepted.append(cut)
    raise PlanError(
        f"{name} of shape {list(shape)}: expected the whole mask {list(whole)}"
        + (f" or one cut {rows.parts} ways: {[list(a) for a in accepted[1:]]}" if rows else "")
    )
