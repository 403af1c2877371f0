"""2D tensor parallelism (Optimus, Xu et al. 2021): the layers on a q x q SUMMA grid.

Layout, with rank (i, j) = (grid row, grid column), see ``grid.py``:

* activations ``[batch, ..., hidden]``: batch block i (``split_batch``), hidden block j;
* ``Linear`` weight ``W[in, out]``: block (i, j) (nn.Linear's ``[out/q, in/q]``);
* biases, norms and embedding-dim parameters: split over both axes (1/q^2 per
  rank) and all-gathered down the grid column when used;
* every rank holds 1/q^2 = 1/T of each sharded parameter; only ``Classifier``'s
  bias (``num_classes`` values, rarely divisible by q^2) is replicated.

The same classes serve 2.5D (Tesseract): the grid then has a depth axis that
splits the batch further and sums weight gradients (``grid.replicated``).
Each layer is made from the dense module it replaces (``base.ShardedModule``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.tensor.base import (
    ShardedModule,
    check_divisible,
    linear_dims,
    own_forward,
)
from gridtrain.parallel.tensor.mode_2d.grid import (
    SummaGrid,
    both_axes,
    check_width,
    gather_col,
    grid_of,
    matmul_ab,
    replicated,
)
from gridtrain.parallel.tensor.norm import norm_kind, norm_over_group


class _GridModule(ShardedModule):
    def __init__(self, dense: nn.Module, ctx):
        super().__init__(dense, ctx)
        self.grid: SummaGrid = grid_of(self.ctx)

    def extra_repr(self) -> str:
        return repr(self.grid)


class Linear(_GridModule):
    """``y = x W^T + b`` by SUMMA; input and output blocked (batch over rows, hidden over columns).

    A full-width input (e.g. raw features after ``split_batch``) is cut to this rank's
    column block first. ``packed=k``: the output packs k blocks (fused q/k/v), each
    split over the grid columns, so a column's output holds whole heads of each.
    """

    def __init__(self, dense: nn.Module, ctx=None, *, packed: int = 1):
        super().__init__(dense, ctx)
        g = self.grid
        self.in_features, self.out_features, self.transposed = linear_dims(dense)
        check_divisible("Linear", "in_features", self.in_features, g.q, "split over grid rows")
        check_divisible(
            "Linear", "out_features", self.out_features, g.q * packed, "split over grid columns"
        )
        out_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        self.shard("weight", [(out_dim, g.row_mode, packed), (in_dim, g.col_mode)])
        if dense.bias is not None:
            check_divisible(
                "Linear", "out_features", self.out_features, g.q**2, "the bias is split q^2 ways"
            )
        self.shard("bias", both_axes(0, g, packed))

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        if g.q > 1 and x.shape[-1] == self.in_features:
            x = comm.split_to_group(x, -1, g.row_group)
        check_width("Linear", x, self.in_features // g.q)
        lead = x.shape[:-1]
        w = replicated(self.weight, g)
        y = matmul_ab(x.reshape(-1, x.shape[-1]), w if self.transposed else w.t(), g)
        if self.bias is not None:
            y = y + gather_col(self.bias, 0, g)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.grid}"


class Norm(_GridModule):
    """LayerNorm or RMSNorm over a hidden dim blocked over the grid row (statistics
    all-reduced along it, in fp32); ``offset=1`` scales by ``1 + weight`` (Gemma)."""

    def __init__(self, dense: nn.Module, ctx=None, *, offset: float = 0.0):
        super().__init__(dense, ctx)
        g, kind = self.grid, norm_kind(dense)
        if kind is None:
            raise TypeError(f"Norm: {type(dense).__name__} is not a LayerNorm or an RMSNorm")
        self.kind, self.offset = kind, offset
        by = g.q**2 if kind.has_weight or kind.has_bias else g.q
        check_divisible("Norm", "hidden", kind.hidden, by, "hidden blocks x parameter split")
        for name, held in (("weight", kind.has_weight), ("bias", kind.has_bias)):
            if held:
                self.shard(name, both_axes(0, g))
            else:  # a weightless norm (OLMo's), or one without bias
                self.register_parameter(name, None)

    def forward(self, x: Tensor) -> Tensor:
        g, k = self.grid, self.kind
        check_width("Norm", x, k.hidden // g.q)
        w, b = (gather_col(t, 0, g) if t is not None else None for t in (self.weight, self.bias))
        return norm_over_group(x, k, g.row_group, w, b, self.offset)

    def extra_repr(self) -> str:
        scale = ", (1 + weight)" if self.offset else ""
        kind = "rms" if self.kind.rms else "layer"
        return f"{kind} norm over {self.kind.hidden}{scale}, {self.grid}"


class Embedding(_GridModule):
    """Token embedding with the embedding dim split (1/q^2); output blocked like activations.

    An embedding class with its own forward (OPT's learned positions, Gemma's scaled rows)
    runs that forward on this rank's block of the table (``own_forward``)."""

    def __init__(self, dense: nn.Embedding, ctx=None):
        super().__init__(dense, ctx)
        g = self.grid
        check_divisible("Embedding", "embedding_dim", dense.embedding_dim, g.q**2, "split q^2 ways")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        self.shard("weight", both_axes(1, g))
        self.own_forward = own_forward(self, g.q)

    def forward(self, *args, **kwargs) -> Tensor:
        w = gather_col(self.weight, 1, self.grid)
        if self.own_forward:
            return self.run_dense({"weight": w}, *args, **kwargs)
        return F.embedding(args[0], w, self.padding_idx)


class Classifier(_GridModule):
    """``logits = x W^T + b`` gathered: ``[batch block, classes]`` on every rank of a grid row.

    The weight's input dim is split over both axes, like ``Embedding``'s embedding dim,
    so the two can share one tensor. The bias is replicated.
    """

    def __init__(self, dense: nn.Module, ctx=None):
        super().__init__(dense, ctx)
        g = self.grid
        self.in_features, self.num_classes, self.transposed = linear_dims(dense)
        check_divisible("Classifier", "in_features", self.in_features, g.q**2, "split q^2 ways")
        self.in_dim = 0 if self.transposed else 1
        self.shard("weight", both_axes(self.in_dim, g))
        self.shard("bias")

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        check_width("Classifier", x, self.in_features // g.q)
        w = gather_col(self.weight, self.in_dim, g)
        partial = x @ (w if self.transposed else w.t())
        # one logit tensor, replicated along the row: the loss's gradient passes unchanged
        logits = comm.reduce_from_group(partial, g.row_group)
        if self.bias is not None:
            # every batch block adds the same bias: sum their gradients
            logits = logits + replicated(comm.copy_to_group(self.bias, g.col_group), g)
        return logits


class PatchEmbedding(_GridModule):
    """ViT stem: ``[batch block, C, H, W] -> [batch block, 1 + patches, embed block]``."""

    def __init__(self, dense: nn.Module, ctx=None):
        super().__init__(dense, ctx)
        g = self.grid
        check_divisible("PatchEmbedding", "embed_size", dense.embed_size, g.q**2, "split q^2 ways")
        self.patch_size = dense.patch_size
        for name, dim in (("weight", 0), ("bias", 0), ("cls_token", 2), ("pos_embed", 2)):
            self.shard(name, both_axes(dim, g))

    def forward(self, x: Tensor) -> Tensor:
        g = self.grid
        x = comm.copy_to_group(x, g.row_group)  # every column convolves the same images
        w, b = gather_col(self.weight, 0, g), gather_col(self.bias, 0, g)
        x = F.conv2d(x, w, b, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = gather_col(self.cls_token, 2, g).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + gather_col(self.pos_embed, 2, g)
