"""Dropout on tensor-parallel activations: which random stream a mask is drawn from.

Replicated activations (every rank of the tensor group holds the same values)
must draw the same mask on every rank: the default generator, seeded alike.
Sharded or blocked activations (each rank holds different values) draw from
``ctx.fork_rng(mode)``, a stream distinct per rank of ``mode``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.base import CtxRef
from gridtrain.parallel.tensor.vocab import is_vocab_sharded


class ParallelDropout(nn.Module):
    """``nn.Dropout`` whose mask comes from ``rng_mode``'s stream (None: the default one,
    except for vocab-sharded logits, which always use ``vocab_mode``'s)."""

    gt_parallel = True

    def __init__(
        self,
        dense: nn.Dropout,
        ctx,
        rng_mode: ParallelMode | None,
        vocab_mode: ParallelMode | None = None,
    ):
        super().__init__()
        self.p, self.inplace = dense.p, dense.inplace
        self.rng_mode, self.vocab_mode = rng_mode, vocab_mode
        self._ctx = CtxRef(ctx)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        mode = self.rng_mode
        if mode is None and self.vocab_mode is not None and is_vocab_sharded(x):
            mode = self.vocab_mode
        if mode is None or self._ctx.ctx.world_size(mode) == 1:
            return F.dropout(x, self.p, True, self.inplace)
        with self._ctx.ctx.fork_rng(mode):
            return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        stream = self.rng_mode.name if self.rng_mode else "replicated"
        return f"p={self.p}, inplace={self.inplace}, mask stream={stream}"


def dropout_factory(rng_mode: ParallelMode | None, vocab_mode: ParallelMode | None = None):
    """A layer-table factory: ``ParallelDropout`` drawing from ``rng_mode``'s stream, or from
    the shared one where the plan says its input is not split (``sharded=False``)."""

    def build(dense: nn.Dropout, ctx, sharded: bool = True, **_) -> ParallelDropout:
        return ParallelDropout(dense, ctx, rng_mode if sharded else None, vocab_mode)

    return build
