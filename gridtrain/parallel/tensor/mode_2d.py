"""2D tensor parallelism (Optimus, Xu et al. 2021): the layer set on a q x q SUMMA grid.

Layout, with rank (i, j) = (grid row, grid column), see ``summa.py``:

* activations ``[batch, ..., hidden]``: batch block i (``split_batch``), hidden block j;
* ``Linear`` weight ``W[in, out]``: block (i, j); stored as nn.Linear's ``[out/q, in/q]``;
* biases, LayerNorm and embedding-dim parameters: split over both axes (1/q^2 per
  rank) and all-gathered down the grid column when used;
* every rank holds 1/q^2 = 1/T of each sharded parameter; only ``Classifier``'s
  bias (``num_classes`` values, rarely divisible by q^2) is replicated.

The same classes serve 2.5D (``mode_2p5d``): the grid then has a depth axis that
splits the batch further and sums weight gradients (``summa.replicated``).
Each layer is initialised by building its dense twin on the CPU from the default
generator (identical on every rank) and keeping this rank's shard, so a model
starts from the same weights as the one built with no parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sharding import get_shard_spec, set_shard_spec, shard_tensor
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor.summa import (
    SummaGrid,
    gather_col,
    matmul_ab,
    matmul_abt,
    replicated,
)
from gridtrain.parallel.tensor.summa_loss import (
    VOCAB_PARALLEL_TAG,
    CrossEntropyLoss,
    accuracy,
    split_batch,
)

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


def _grid(ctx: ParallelContext | None) -> SummaGrid:
    return SummaGrid.of(ctx or get_context())


def _divides(layer: str, arg: str, value: int, by: int, why: str) -> None:
    if value % by:
        raise ValueError(f"{layer}: {arg}={value} must be divisible by {by} ({why})")


def _shard(full: Tensor, spec, grid: SummaGrid, device) -> nn.Parameter:
    """This rank's shard of dense tensor ``full`` as a parameter tagged with ``spec``."""
    shard = shard_tensor(full.detach(), spec, grid.ctx)
    param = nn.Parameter(shard.to(device or grid.ctx.device))
    return set_shard_spec(param, *spec)


def _both_axes(dim: int, g: SummaGrid):
    """Split ``dim`` over grid columns, then each column's block over grid rows (1/q^2)."""
    return ((dim, g.row_mode), (dim, g.col_mode))


def _check_width(layer: str, x: Tensor, width: int) -> None:
    if x.shape[-1] != width:
        raise ValueError(
            f"{layer}: input's last dim is {x.shape[-1]}, expected this rank's hidden block of {width}"
        )


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
        g = self.grid = _grid(ctx)
        _divides("Linear", "in_features", in_features, g.q, "split over the grid rows")
        _divides("Linear", "out_features", out_features, g.q, "split over the grid columns")
        if bias:
            _divides("Linear", "out_features", out_features, g.q**2, "the bias is split q^2 ways")
        self.in_features, self.out_features = in_features, out_features
        twin = nn.Linear(in_features, out_features, bias, dtype=dtype)
        # nn.Linear stores [out, in]: out over grid columns, in over grid rows
        self.weight = _shard(twin.weight, ((0, g.row_mode), (1, g.col_mode)), g, device)
        if bias:
            self.bias = _shard(twin.bias, _both_axes(0, g), g, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        if g.q > 1 and x.shape[-1] == self.in_features:
            x = comm.split_to_group(x, -1, g.row_group)
        _check_width("Linear", x, self.in_features // g.q)
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
        shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        if len(shape) != 1:
            raise ValueError(f"LayerNorm: normalized_shape must be one dim, got {normalized_shape}")
        g = self.grid = _grid(ctx)
        self.hidden, self.eps = shape[0], eps
        by = g.q**2 if elementwise_affine else g.q
        _divides(
            "LayerNorm", "normalized_shape", self.hidden, by, "hidden blocks x parameter split"
        )
        twin = nn.LayerNorm(self.hidden, eps, elementwise_affine, bias, dtype=dtype)
        self.weight = (
            _shard(twin.weight, _both_axes(0, g), g, device) if elementwise_affine else None
        )
        self.bias = (
            _shard(twin.bias, _both_axes(0, g), g, device) if twin.bias is not None else None
        )

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        _check_width("LayerNorm", x, self.hidden // g.q)
        xf = x.float()
        # each rank uses the row's statistics for its own block: sum the gradients back
        mean = comm.all_reduce(xf.sum(-1, keepdim=True), g.row_group) / self.hidden
        xc = xf - mean
        var = comm.all_reduce((xc * xc).sum(-1, keepdim=True), g.row_group) / self.hidden
        y = (xc * torch.rsqrt(var + self.eps)).to(x.dtype)
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
        g = self.grid = _grid(ctx)
        _divides("Embedding", "embedding_dim", embedding_dim, g.q**2, "split q^2 ways")
        twin = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        self.weight = _shard(twin.weight, _both_axes(1, g), g, device)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, gather_col(self.weight, 1, self.grid), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.grid}"


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
        g = self.grid = _grid(ctx)
        _divides("VocabParallelEmbedding", "num_embeddings", num_embeddings, g.q, "vocab blocks")
        _divides("VocabParallelEmbedding", "embedding_dim", embedding_dim, g.q, "hidden blocks")
        twin = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        self.weight = _shard(twin.weight, ((0, g.col_mode), (1, g.row_mode)), g, device)
        self.vocab_start = g.i * (num_embeddings // g.q)

    def forward(self, ids: Tensor) -> Tensor:
        g, n = self.grid, self.num_embeddings // self.grid.q
        ids = comm.all_gather_raw(ids, 0, g.col_group)  # every batch block of this column
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < n)
        pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < n:
            pad = self.padding_idx - self.vocab_start
        out = F.embedding(local.masked_fill(~mine, 0), replicated(self.weight, g), pad)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return comm.reduce_scatter(out, 0, g.col_group)

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
        g = self.grid = _grid(ctx)
        _divides("Classifier", "in_features", in_features, g.q**2, "split q^2 ways")
        self.in_features, self.num_classes = in_features, num_classes
        spec = _both_axes(1, g)
        if weight is None:
            twin = dense.Classifier(in_features, num_classes, bias=False, dtype=dtype)
            weight = _shard(twin.weight, spec, g, None)
        elif get_shard_spec(weight) != spec or tuple(weight.shape) != (
            num_classes,
            in_features // g.q**2,
        ):
            raise ValueError(
                f"Classifier: a tied weight must be a {g.q}x{g.q} Embedding's weight of dense "
                f"shape ({num_classes}, {in_features}); got local shape {tuple(weight.shape)} "
                f"with shard spec {get_shard_spec(weight)}"
            )
        self.weight = weight
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_classes, dtype=dtype, device=g.ctx.device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        _check_width("Classifier", x, self.in_features // g.q)
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
        g = self.grid = _grid(ctx)
        name = "VocabParallelClassifier"
        _divides(name, "in_features", in_features, g.q, "hidden blocks")
        _divides(name, "num_classes", num_classes, g.q**2 if bias else g.q, "vocab blocks")
        self.in_features, self.num_classes = in_features, num_classes
        spec = ((0, g.col_mode), (1, g.row_mode))
        if weight is None:
            twin = dense.Classifier(in_features, num_classes, bias=False, dtype=dtype)
            weight = _shard(twin.weight, spec, g, None)
        elif get_shard_spec(weight) != spec or tuple(weight.shape) != (
            num_classes // g.q,
            in_features // g.q,
        ):
            raise ValueError(
                f"{name}: a tied weight must be a VocabParallelEmbedding's weight of dense shape "
                f"({num_classes}, {in_features}); got local shape {tuple(weight.shape)} "
                f"with shard spec {get_shard_spec(weight)}"
            )
        self.weight = weight
        if bias:
            self.bias = _shard(torch.zeros(num_classes, dtype=dtype), _both_axes(0, g), g, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        _check_width("VocabParallelClassifier", x, self.in_features // g.q)
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
        g = self.grid = _grid(ctx)
        _divides("PatchEmbedding", "embed_size", embed_size, g.q**2, "split q^2 ways")
        twin = dense.PatchEmbedding(img_size, patch_size, in_chans, embed_size, dtype=dtype)
        self.patch_size = patch_size
        self.weight = _shard(twin.weight, _both_axes(0, g), g, None)
        self.bias = _shard(twin.bias, _both_axes(0, g), g, None)
        self.cls_token = _shard(twin.cls_token, _both_axes(2, g), g, None)
        self.pos_embed = _shard(twin.pos_embed, _both_axes(2, g), g, None)

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
        self.grid = _grid(ctx)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        with self.grid.ctx.fork_rng(ParallelMode.TENSOR):
            return super().forward(x)
