"""Vocabulary-parallel layers on the SUMMA grid (2D and 2.5D): the vocab split over grid rows.

``VocabParallelEmbedding`` and ``VocabParallelClassifier`` hold ``[vocab/q, hidden/q]``
blocks of the same dense ``[vocab, hidden]`` tensor, cut the same way, so one
tensor can serve both (tied weights). The classifier's logits stay blocked
``[batch block, vocab block j]`` and are marked vocab-sharded for the loss.
"""

from __future__ import annotations

from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.tensor.base import check_divisible, linear_dims
from gridtrain.parallel.tensor.mode_2d.grid import (
    both_axes,
    check_width,
    gather_col,
    matmul_abt,
    replicated,
)
from gridtrain.parallel.tensor.mode_2d.layers import _GridModule
from gridtrain.parallel.tensor.vocab import mark_vocab_sharded, vocab_block_lookup


class VocabParallelEmbedding(_GridModule):
    """Embedding with the vocabulary split over grid rows and the dim over grid columns.

    Each grid column gathers its rows' token ids, looks up its vocabulary block
    and reduce-scatters the partial embeddings back to their batch blocks.
    """

    def __init__(self, dense: nn.Embedding, ctx=None):
        super().__init__(dense, ctx)
        g, name = self.grid, "VocabParallelEmbedding"
        check_divisible(name, "num_embeddings", dense.num_embeddings, g.q, "vocab blocks")
        check_divisible(name, "embedding_dim", dense.embedding_dim, g.q, "hidden blocks")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        self.shard("weight", [(0, g.col_mode), (1, g.row_mode)])
        self.vocab_start = g.i * (dense.num_embeddings // g.q)

    def forward(self, ids: Tensor) -> Tensor:
        g, n = self.grid, self.num_embeddings // self.grid.q
        ids = comm.all_gather_raw(ids, 0, g.col_group)  # every batch block of this column
        out = vocab_block_lookup(
            ids, replicated(self.weight, g), self.vocab_start, n, self.padding_idx
        )
        return comm.reduce_scatter(out, 0, g.col_group)


class VocabParallelClassifier(_GridModule):
    """``logits = x W^T + b`` by SUMMA ``A B^T``; logits stay blocked ``[batch block, vocab block]``.

    The weight is split like ``VocabParallelEmbedding``'s (one tensor can serve both).
    """

    def __init__(self, dense: nn.Module, ctx=None):
        super().__init__(dense, ctx)
        g, name = self.grid, "VocabParallelClassifier"
        self.in_features, self.num_classes, self.transposed = linear_dims(dense)
        check_divisible(name, "in_features", self.in_features, g.q, "hidden blocks")
        by = g.q**2 if dense.bias is not None else g.q
        check_divisible(name, "num_classes", self.num_classes, by, "vocab blocks")
        vocab_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        self.shard("weight", [(vocab_dim, g.col_mode), (in_dim, g.row_mode)])
        self.shard("bias", both_axes(0, g))

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        check_width("VocabParallelClassifier", x, self.in_features // g.q)
        lead = x.shape[:-1]
        w = replicated(self.weight, g)
        logits = matmul_abt(x.reshape(-1, x.shape[-1]), w.t() if self.transposed else w, g)
        if self.bias is not None:
            logits = logits + gather_col(self.bias, 0, g)
        return mark_vocab_sharded(logits.reshape(*lead, logits.shape[-1]))
