"""2D tensor parallelism (Optimus, Xu et al. 2021): the layer set on a q x q SUMMA grid.

Layout, with rank (i, j) = (grid row, grid column), see ``summa.py``:

* activations ``[batch, ..., hidden]``: batch block i (``split_batch``), hidden block j;
* ``Linear`` weight ``W[in, out]``: block (i, j); stored as nn.Linear's ``[out/q, in/q]``;
* biases, LayerNorm and embedding-dim parameters: split over both axes (1/q^2 per
  rank) and all-gathered down the grid column when used;
* every rank holds 1/q^2 = 1/T of each sharded parameter; only ``Classifier``'s
  bias (``num_classes`` values, rarely divisible by q^2) is replicated.

The vocabulary-parallel pair lives in ``summa_vocab``, the batch split, cross
entropy and accuracy in ``summa_loss``; this module exports the whole set.
The same classes serve 2.5D (``mode_2p5d``): the grid then has a depth axis that
splits the batch further and sums weight gradients (``summa.replicated``).
Each layer is initialised by building its dense twin on the CPU from the default
generator (identical on every rank) and keeping this rank's shard, so a model
starts from the same weights as the one built with no parallelism.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor.common import (
    check_divisible,
    layer_norm_width,
    normalize_over_group,
)
from gridtrain.parallel.tensor.summa import (
    both_axes,
    check_width,
    classifier_weight,
    copy_from_twin,
    gather_col,
    grid_of,
    matmul_ab,
    replicated,
    shard_param,
)
from gridtrain.parallel.tensor.summa_loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.summa_vocab import VocabParallelClassifier, VocabParallelEmbedding

__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "split_batch",
]


class Linear(nn.Module):
    """``y = x W^T + b`` by SUMMA; input and output blocked (batch over rows, hidden over columns).

    A full-width input (e.g. raw features after ``split_batch``) is cut to this
    rank's column block first.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        g = self.grid = grid_of(ctx)
        check_divisible("Linear", "in_features", in_features, g.q, "split over the grid rows")
        check_divisible("Linear", "out_features", out_features, g.q, "split over the grid columns")
        if bias:
            check_divisible(
                "Linear", "out_features", out_features, g.q**2, "the bias is split q^2 ways"
            )
        self.in_features, self.out_features = in_features, out_features
        self._twin = functools.partial(nn.Linear, in_features, out_features, bias, dtype=dtype)
        twin = self._twin()
        # nn.Linear stores [out, in]: out over grid columns, in over grid rows
        self.weight = shard_param(twin.weight, ((0, g.row_mode), (1, g.col_mode)), g, device)
        if bias:
            self.bias = shard_param(twin.bias, both_axes(0, g), g, device)
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """The dense layer's init (same draws), this rank's shard of it."""
        copy_from_twin(self, self._twin())

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        if g.q > 1 and x.shape[-1] == self.in_features:
            x = comm.split_to_group(x, -1, g.row_group)
        check_width("Linear", x, self.in_features // g.q)
        lead = x.shape[:-1]
        w = replicated(self.weight, g)
        y = matmul_ab(x.reshape(-1, x.shape[-1]), w.t(), g)
        if self.bias is not None:
            y = y + gather_col(self.bias, 0, g)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.grid}"


class LayerNorm(nn.Module):
    """LayerNorm over a hidden dim blocked over the grid row (statistics all-reduced along it)."""

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        g = self.grid = grid_of(ctx)
        self.hidden, self.eps = layer_norm_width(normalized_shape), eps
        by = g.q**2 if elementwise_affine else g.q
        check_divisible(
            "LayerNorm", "normalized_shape", self.hidden, by, "hidden blocks x parameter split"
        )
        self._twin = functools.partial(
            nn.LayerNorm, self.hidden, eps, elementwise_affine, bias, dtype=dtype
        )
        twin = self._twin()
        self.weight = (
            shard_param(twin.weight, both_axes(0, g), g, device) if elementwise_affine else None
        )
        self.bias = (
            shard_param(twin.bias, both_axes(0, g), g, device) if twin.bias is not None else None
        )

    def reset_parameters(self) -> None:
        """The dense layer's init (same draws), this rank's shard of it."""
        copy_from_twin(self, self._twin())

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        check_width("LayerNorm", x, self.hidden // g.q)
        # statistics over the grid row, always in fp32
        y = normalize_over_group(x.float(), self.hidden, self.eps, g.row_group).to(x.dtype)
        if self.weight is not None:
            y = y * gather_col(self.weight, 0, g)
        if self.bias is not None:
            y = y + gather_col(self.bias, 0, g)
        return y

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, {self.grid}"


class Embedding(nn.Module):
    """Token embedding with the embedding dim split (1/q^2); output blocked like activations."""

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
        check_divisible("Embedding", "embedding_dim", embedding_dim, g.q**2, "split q^2 ways")
        self._twin = functools.partial(
            nn.Embedding, num_embeddings, embedding_dim, padding_idx, dtype=dtype
        )
        twin = self._twin()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        self.weight = shard_param(twin.weight, both_axes(1, g), g, device)

    def reset_parameters(self) -> None:
        """The dense layer's init (same draws), this rank's shard of it."""
        copy_from_twin(self, self._twin())

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, gather_col(self.weight, 1, self.grid), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.grid}"


class Classifier(nn.Module):
    """``logits = x W^T + b`` gathered: ``[batch block, num_classes]`` on every rank of a grid row.

    ``weight`` ``[num_classes, in/q^2]`` is split like ``Embedding``'s, so an
    embedding's weight can be passed to tie them. The bias is replicated.
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
        check_divisible("Classifier", "in_features", in_features, g.q**2, "split q^2 ways")
        self.in_features, self.num_classes = in_features, num_classes
        spec = both_axes(1, g)
        self.weight = classifier_weight(
            "Classifier", weight, spec, in_features, num_classes, g, dtype
        )
        if bias:
            self.bias = shard_param(torch.zeros(num_classes, dtype=dtype), (), g, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        check_width("Classifier", x, self.in_features // g.q)
        partial = x @ gather_col(self.weight, 1, g).t()
        # one logit tensor, replicated along the row: the loss's gradient passes unchanged
        logits = comm.reduce_from_group(partial, g.row_group)
        if self.bias is not None:
            # every batch block adds the same bias: sum their gradients
            bias = replicated(comm.copy_to_group(self.bias, g.col_group), g)
            logits = logits + bias
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, {self.grid}"


class PatchEmbedding(nn.Module):
    """ViT stem: ``[batch block, C, H, W] -> [batch block, 1 + patches, embed block]``.

    Conv filters, bias, class token and position embeddings are split over the
    embedding dim (1/q^2) and gathered down the grid column.
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        g = self.grid = grid_of(ctx)
        check_divisible("PatchEmbedding", "embed_size", embed_size, g.q**2, "split q^2 ways")
        twin = dense.PatchEmbedding(img_size, patch_size, in_chans, embed_size, dtype=dtype)
        self.patch_size = patch_size
        self.weight = shard_param(twin.weight, both_axes(0, g), g, None)
        self.bias = shard_param(twin.bias, both_axes(0, g), g, None)
        self.cls_token = shard_param(twin.cls_token, both_axes(2, g), g, None)
        self.pos_embed = shard_param(twin.pos_embed, both_axes(2, g), g, None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        x = comm.copy_to_group(x, g.row_group)  # every column convolves the same images
        w, b = gather_col(self.weight, 0, g), gather_col(self.bias, 0, g)
        x = F.conv2d(x, w, b, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = gather_col(self.cls_token, 2, g).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + gather_col(self.pos_embed, 2, g)


class Dropout(nn.Dropout):
    """Dropout on blocked activations: each rank holds a different block, so a distinct mask."""

    def __init__(
        self, p: float = 0.5, inplace: bool = False, *, ctx: ParallelContext | None = None
    ):
        super().__init__(p, inplace)
        self.grid = grid_of(ctx)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        with self.grid.ctx.fork_rng(ParallelMode.TENSOR):
            return super().forward(x)
