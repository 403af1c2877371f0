"""Vocabulary-parallel layers on the SUMMA grid (2D and 2.5D): the vocab split over grid rows.

``VocabParallelEmbedding`` and ``VocabParallelClassifier`` hold ``[vocab/q, hidden/q]``
blocks of the same dense ``[vocab, hidden]`` tensor, cut the same way, so passing the
embedding's weight to the classifier ties them. The classifier's logits stay blocked
``[batch block, vocab block]`` and are tagged for ``summa_loss``'s cross entropy and
accuracy.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.common import check_divisible, vocab_block_lookup
from gridtrain.parallel.tensor.summa import (
    both_axes,
    check_width,
    classifier_weight,
    copy_from_twin,
    gather_col,
    grid_of,
    matmul_abt,
    replicated,
    shard_param,
)
from gridtrain.parallel.tensor.vocab_loss import VOCAB_PARALLEL_TAG


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over grid rows and the dim over grid columns.

    Each grid column gathers its rows' token ids, looks up its vocabulary block
    and reduce-scatters the partial embeddings back to their batch blocks.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        g = self.grid = grid_of(ctx)
        check_divisible(
            "VocabParallelEmbedding", "num_embeddings", num_embeddings, g.q, "vocab blocks"
        )
        check_divisible(
            "VocabParallelEmbedding", "embedding_dim", embedding_dim, g.q, "hidden blocks"
        )
        self._twin = functools.partial(
            nn.Embedding, num_embeddings, embedding_dim, padding_idx, dtype=dtype
        )
        twin = self._twin()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        self.weight = shard_param(twin.weight, ((0, g.col_mode), (1, g.row_mode)), g, device)
        self.vocab_start = g.i * (num_embeddings // g.q)

    def reset_parameters(self) -> None:
        """The dense layer's init (same draws), this rank's shard of it."""
        copy_from_twin(self, self._twin())

    def forward(self, ids: Tensor) -> Tensor:
        g, n = self.grid, self.num_embeddings // self.grid.q
        ids = comm.all_gather_raw(ids, 0, g.col_group)  # every batch block of this column
        w = replicated(self.weight, g)
        out = vocab_block_lookup(ids, w, self.vocab_start, n, self.padding_idx)
        return comm.reduce_scatter(out, 0, g.col_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.grid}"


class VocabParallelClassifier(nn.Module):
    """``logits = x W^T + b`` by SUMMA ``A B^T``; logits stay blocked ``[batch block, vocab block]``.

    ``weight`` is split like ``VocabParallelEmbedding``'s (tie by passing it).
    Pair with this mode's ``CrossEntropyLoss``/``accuracy``, which recognise the
    output (or a view of it) as vocab-parallel.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        g = self.grid = grid_of(ctx)
        name = "VocabParallelClassifier"
        check_divisible(name, "in_features", in_features, g.q, "hidden blocks")
        check_divisible(name, "num_classes", num_classes, g.q**2 if bias else g.q, "vocab blocks")
        self.in_features, self.num_classes = in_features, num_classes
        spec = ((0, g.col_mode), (1, g.row_mode))
        self.weight = classifier_weight(name, weight, spec, in_features, num_classes, g, dtype)
        if bias:
            self.bias = shard_param(torch.zeros(num_classes, dtype=dtype), both_axes(0, g), g, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        check_width("VocabParallelClassifier", x, self.in_features // g.q)
        lead = x.shape[:-1]
        logits = matmul_abt(x.reshape(-1, x.shape[-1]), replicated(self.weight, g), g)
        if self.bias is not None:
            logits = logits + gather_col(self.bias, 0, g)
        logits = logits.reshape(*lead, logits.shape[-1])
        for t in (logits, logits._base):  # views of the output share its _base: tag that too
            if t is not None:
                setattr(t, VOCAB_PARALLEL_TAG, True)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, {self.grid}"
