"""The 3D cube (Bian et al. 2021): axes, layout orientation, batch split, loss and accuracy.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode as PM

AXIS_A, AXIS_B, AXIS_C = PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT
PAIR = {AXIS_B: PM.PARALLEL_3D_INPUT_X_WEIGHT, AXIS_C: PM.PARALLEL_3D_OUTPUT_X_WEIGHT}
VOCAB_PARALLEL_TAG = "_gt_vocab_parallel"  # same tag as the SUMMA modes' vocab-parallel logits

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


def divides(layer: str, arg: str, value: int, by: int, why: str) -> None:
    """Raise a ValueError naming the argument unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{layer}: {arg}={value} must be divisible by {by} ({why})")


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


def labels_for_rows(labels: Tensor, row: PM, ctx: ParallelContext) -> Tensor:
    """``split_batch``'s rows (a, c) re-cut to rows (a, g) for the row axis ``row`` (B or C)."""
    if row == AXIS_C:
        return labels
    block = comm.all_gather_raw(labels, 0, ctx.group(AXIS_C))  # the whole batch block a
    return block.chunk(ctx.world_size(row), dim=0)[ctx.local_rank(row)]


# ---- cross entropy and accuracy -------------------------------------------------------------
def is_vocab_parallel(logits: Tensor) -> bool:
    """Whether ``logits`` (or the tensor it is a view of) came from a VocabParallelClassifier."""
    base = logits._base if logits._base is not None else logits
    return bool(getattr(logits, VOCAB_PARALLEL_TAG, False) or getattr(base, VOCAB_PARALLEL_TAG, False))


# Gathered logits (Classifier): rows (a, c), every class, replicated over B -> rows summed over A x C.
# Vocab-parallel logits (VocabParallelClassifier): rows (a, b), vocab block c -> summed over A x B.
_ROWS_SUM = {False: PAIR[AXIS_C], True: PAIR[AXIS_B]}


def _vocab_nll(logits: Tensor, labels: Tensor, ignore_index: int, ctx: ParallelContext) -> Tensor:
    """Per-sample ``logsumexp - target logit`` over the vocab blocks of axis C (Megatron's form)."""
    group, n = ctx.group(AXIS_C), logits.shape[-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted = logits - comm.all_reduce_max(logits.max(-1, keepdim=True).values, group)
    # the C ranks compute one loss from these sums: reduce forward, pass the gradient unchanged
    sum_exp = comm.reduce_from_group(shifted.exp().sum(-1), group)
    local = labels - ctx.local_rank(AXIS_C) * n
    mine = (local >= 0) & (local < n) & (labels != ignore_index)
    picked = shifted.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    target = comm.reduce_from_group(picked.masked_fill(~mine, 0.0), group)
    return (sum_exp.log() - target).masked_fill(labels == ignore_index, 0.0)


class CrossEntropyLoss(nn.Module):
    """Cross entropy of 3D logits; every rank of the tensor group gets the dense run's value.

    Takes ``nn.CrossEntropyLoss``'s arguments; labels come from ``split_batch``.
    Vocab-parallel logits are recognised from ``VocabParallelClassifier``'s tag
    (kept by views); pass ``vocab_parallel=True`` for a copy of them. Each rank
    back-propagates only its own rows' share; ``reduction="none"`` returns this
    rank's rows of per-sample losses (rows (a, b) for vocab-parallel logits).
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        vocab_parallel: bool | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(
                f"CrossEntropyLoss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
            )
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.vocab_parallel = label_smoothing, vocab_parallel
        self.cube = Cube.of(ctx or get_context())

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        ctx = self.cube.ctx
        vocab_parallel = self.vocab_parallel
        if vocab_parallel is None:
            vocab_parallel = is_vocab_parallel(logits)
        if vocab_parallel:
            labels = labels_for_rows(labels, AXIS_B, ctx)
        if tuple(logits.shape[:-1]) != tuple(labels.shape):
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} must be labels "
                f"{tuple(labels.shape)} plus a last class dim"
            )
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = labels != self.ignore_index
        if vocab_parallel:
            if self.weight is not None or self.label_smoothing:
                raise NotImplementedError(
                    "CrossEntropyLoss: class weight and label_smoothing are not supported on "
                    "vocab-parallel logits"
                )
            per_sample = _vocab_nll(logits, labels, self.ignore_index, ctx)
            count = valid.sum().to(per_sample.dtype)
        else:
            per_sample = F.cross_entropy(
                logits,
                labels,
                self.weight,
                ignore_index=self.ignore_index,
                reduction="none",
                label_smoothing=self.label_smoothing,
            )
            if self.weight is None:
                count = valid.sum().to(per_sample.dtype)
            else:  # torch's weighted mean divides by the weights of the targets
                count = self.weight[labels.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        if self.reduction == "none":
            return per_sample
        group = ctx.group(_ROWS_SUM[vocab_parallel])
        # replicas of one row block each back-propagate the same loss: identity backward
        total = comm.reduce_from_group(per_sample.sum(), group)
        if self.reduction == "sum":
            return total
        return total / comm.all_reduce_(count.detach().clone(), group)


def _vocab_argmax(logits: Tensor, ctx: ParallelContext) -> Tensor:
    """Global argmax over the vocab blocks of axis C; the first maximum wins, as in torch.argmax."""
    group, n, d = ctx.group(AXIS_C), logits.shape[-1], ctx.world_size(AXIS_C)
    best, index = logits.max(-1)
    top = comm.all_reduce_max(best, group)
    mine = torch.where(best == top, index + ctx.local_rank(AXIS_C) * n, torch.full_like(index, d * n))
    return -comm.all_reduce_max(-mine, group)


@torch.no_grad()
def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's whole batch, on every rank of the cube."""
    ctx = ctx or get_context()
    vocab_parallel = is_vocab_parallel(logits)
    if vocab_parallel:
        labels = labels_for_rows(labels, AXIS_B, ctx)
        pred = _vocab_argmax(logits, ctx)
    else:
        pred = logits.argmax(dim=-1)
    group = ctx.group(_ROWS_SUM[vocab_parallel])
    correct = comm.all_reduce_((pred == labels).sum(), group)
    total = comm.all_reduce_(torch.tensor(labels.numel(), device=labels.device), group)
    return correct, total
