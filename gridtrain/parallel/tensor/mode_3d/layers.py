"""3D tensor parallelism (Bian et al. 2021, "Maximizing Parallelism in Distributed Training
for Huge Neural Networks"): the layers on a d x d x d cube (layout: ``cube.py``).

* ``Linear`` weight ``W[in, out]`` block (in h, out r), split again over INPUT:
  nn.Linear's ``[out/d^2, in/d]``;
* biases, norms, embedding and classifier parameters: split over the hidden axis
  and then over the pair group of the ranks that use the same block;
* every rank holds 1/d^3 = 1/T of each sharded parameter; only ``Classifier``'s bias
  is replicated when ``num_classes`` is not divisible by d^3.

``orientation`` is the orientation of the activations around a layer (the
planner reads it off the data flow): a Linear's input, a norm's input and
output, an embedding's output, a classifier's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.tensor.base import ShardedModule, check_divisible, linear_dims, own_forward
from gridtrain.parallel.tensor.mode_3d.cube import (
    INPUT,
    PAIR,
    Cube,
    as_shard,
    hidden_spec,
    linear_3d,
    swap_orientation,
)
from gridtrain.parallel.tensor.norm import norm_kind, norm_over_group
from gridtrain.parallel.tensor.vocab import mark_vocab_sharded, vocab_block_lookup


class _CubeModule(ShardedModule):
    def __init__(self, dense: nn.Module, ctx, orientation: int):
        super().__init__(dense, ctx)
        self.cube = Cube.of(self.ctx, orientation)

    def extra_repr(self) -> str:
        return repr(self.cube)


class Linear(_CubeModule):
    """``y = x W^T + b`` on the cube; output at the other orientation than the input.

    ``packed=k``: the output packs k blocks (fused q/k/v), each split over the row axis.
    """

    def __init__(self, dense: nn.Module, ctx=None, *, orientation: int = 0, packed: int = 1):
        super().__init__(dense, ctx, orientation)
        cube, d = self.cube, self.cube.d
        self.in_features, self.out_features, self.transposed = linear_dims(dense)
        check_divisible("Linear", "in_features", self.in_features, d, "split over the hidden axis")
        check_divisible(
            "Linear", "out_features", self.out_features, d * d * packed, "split d^2 ways"
        )
        out_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        spec = ((out_dim, cube.row_axis, packed), (out_dim, INPUT), (in_dim, cube.hidden_axis))
        self.shard("weight", spec)
        if dense.bias is not None:
            check_divisible(
                "Linear", "out_features", self.out_features, d**3, "the bias is split d^3 ways"
            )
        self.shard("bias", ((0, cube.row_axis, packed), (0, PAIR[cube.hidden_axis])))

    def forward(self, x: Tensor) -> Tensor:
        x = as_shard("Linear", x, self.in_features, self.cube)
        return linear_3d(x, self.weight, self.bias, self.cube, self.transposed)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.cube}"


class Norm(_CubeModule):
    """LayerNorm or RMSNorm over a hidden dim split over the hidden axis (statistics
    all-reduced over it, in fp32); ``offset=1`` scales by ``1 + weight`` (Gemma)."""

    def __init__(self, dense: nn.Module, ctx=None, *, orientation: int = 0, offset: float = 0.0):
        super().__init__(dense, ctx, orientation)
        kind = norm_kind(dense)
        if kind is None:
            raise TypeError(f"Norm: {type(dense).__name__} is not a LayerNorm or an RMSNorm")
        self.kind, self.offset = kind, offset
        by = self.cube.d**3 if kind.has_weight or kind.has_bias else self.cube.d
        check_divisible("Norm", "hidden", kind.hidden, by, "hidden blocks x parameter split")
        for name, held in (("weight", kind.has_weight), ("bias", kind.has_bias)):
            if held:
                self.shard(name, hidden_spec(0, self.cube))
            else:  # a weightless norm (OLMo's), or one without bias
                self.register_parameter(name, None)

    def forward(self, x: Tensor) -> Tensor:
        cube, k = self.cube, self.kind
        x = as_shard("Norm", x, k.hidden, cube)
        w, b = (
            comm.all_gather(t, 0, cube.group(cube.pair)) if t is not None else None
            for t in (self.weight, self.bias)
        )
        return norm_over_group(x, k, cube.group(cube.hidden_axis), w, b, self.offset)


class _Orientation0(_CubeModule):
    """Embeddings and classifiers compute in orientation 0 and convert to/from ``orientation``."""

    def __init__(self, dense: nn.Module, ctx, orientation: int):
        super().__init__(dense, ctx, 0)
        self.flip = orientation == 1

    def _to_layout(self, y: Tensor) -> Tensor:
        return swap_orientation(y, self.cube) if self.flip else y

    def _from_layout(self, name: str, x: Tensor, width: int) -> Tensor:
        if self.flip:
            if x.shape[-1] != width // self.cube.d:
                raise ValueError(
                    f"{name}: input's last dim is {x.shape[-1]}, expected this rank's hidden "
                    f"block of {width // self.cube.d}"
                )
            x = swap_orientation(x, self.cube.flipped())
        return as_shard(name, x, width, self.cube)


class Embedding(_Orientation0):
    """Token embedding with the embedding dim split (1/d^3 per rank); output laid out like
    activations."""

    def __init__(self, dense: nn.Embedding, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx, orientation)
        d = self.cube.d
        check_divisible("Embedding", "embedding_dim", dense.embedding_dim, d**3, "split d^3 ways")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        self.shard("weight", hidden_spec(1, self.cube))
        self.own_forward = own_forward(self, d * d)  # see mode_2d's Embedding

    def forward(self, *args, **kwargs) -> Tensor:
        w = comm.all_gather(self.weight, 1, self.cube.group(self.cube.pair))
        if self.own_forward:
            return self._to_layout(self.run_dense({"weight": w}, *args, **kwargs))
        return self._to_layout(F.embedding(args[0], w, self.padding_idx))


class VocabParallelEmbedding(_Orientation0):
    """Embedding with the vocabulary split over the row axis (then INPUT) and the dim over
    the hidden axis. Each rank gathers its batch block's token ids, looks up its vocabulary
    block and reduce-scatters the partial embeddings back to its rows."""

    def __init__(self, dense: nn.Embedding, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx, orientation)
        cube, name = self.cube, "VocabParallelEmbedding"
        check_divisible(name, "num_embeddings", dense.num_embeddings, cube.d**2, "vocab split")
        check_divisible(name, "embedding_dim", dense.embedding_dim, cube.d, "hidden blocks")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        self.shard("weight", ((0, cube.row_axis), (0, INPUT), (1, cube.hidden_axis)))

    def forward(self, ids: Tensor) -> Tensor:
        cube, n = self.cube, self.num_embeddings // self.cube.d
        ids = comm.all_gather_raw(ids, 0, cube.group(cube.row_axis))  # the whole batch block
        w = comm.all_gather(self.weight, 0, cube.group(INPUT))
        out = vocab_block_lookup(ids, w, cube.rank(cube.row_axis) * n, n, self.padding_idx)
        return self._to_layout(comm.reduce_scatter(out, 0, cube.group(cube.row_axis)))


class Classifier(_Orientation0):
    """``logits = x W^T + b`` gathered: rows of ``split_batch`` with every class.

    The weight's input dim is split like ``Embedding``'s embedding dim (one tensor can
    serve both). The bias is split d^3 ways when ``num_classes`` allows, else replicated.
    """

    def __init__(self, dense: nn.Module, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx, orientation)
        cube, d = self.cube, self.cube.d
        self.in_features, self.num_classes, self.transposed = linear_dims(dense)
        check_divisible("Classifier", "in_features", self.in_features, d**3, "split d^3 ways")
        self.in_dim = 0 if self.transposed else 1
        self.shard("weight", hidden_spec(self.in_dim, cube))
        self.split_bias = self.num_classes % d**3 == 0
        self.shard("bias", hidden_spec(0, cube) if self.split_bias else ())

    def forward(self, x: Tensor) -> Tensor:
        cube = self.cube
        x = self._from_layout("Classifier", x, self.in_features)
        w = comm.all_gather(self.weight, self.in_dim, cube.group(cube.pair))
        partial = x @ (w if self.transposed else w.t())
        # one logit tensor, replicated over the hidden axis: the loss's gradient passes unchanged
        logits = comm.reduce_from_group(partial, cube.group(cube.hidden_axis))
        if self.bias is None:
            return logits
        if self.split_bias:
            bias = comm.all_gather(self.bias, 0, cube.group(cube.pair))
            bias = comm.gather_from_group(bias, 0, cube.group(cube.hidden_axis))
        else:  # every batch block adds the same bias: sum their gradients
            bias = comm.copy_to_group(self.bias, cube.group(cube.pair))
        return logits + bias


class VocabParallelClassifier(_Orientation0):
    """``logits = x W^T + b`` as a 3D Linear at orientation 0: rows (i, WEIGHT block), vocab
    block over OUTPUT (never gathered); marked vocab-sharded for the loss, which re-cuts
    the labels to those rows. The weight is split like ``VocabParallelEmbedding``'s."""

    def __init__(self, dense: nn.Module, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx, orientation)
        cube, d, name = self.cube, self.cube.d, "VocabParallelClassifier"
        self.in_features, self.num_classes, self.transposed = linear_dims(dense)
        check_divisible(name, "in_features", self.in_features, d, "hidden blocks")
        by = d**3 if dense.bias is not None else d**2
        check_divisible(name, "num_classes", self.num_classes, by, "vocab blocks")
        vocab_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        self.shard(
            "weight", ((vocab_dim, cube.row_axis), (vocab_dim, INPUT), (in_dim, cube.hidden_axis))
        )
        self.shard("bias", ((0, cube.row_axis), (0, PAIR[cube.hidden_axis])))

    def forward(self, x: Tensor) -> Tensor:
        x = self._from_layout("VocabParallelClassifier", x, self.in_features)
        return mark_vocab_sharded(linear_3d(x, self.weight, self.bias, self.cube, self.transposed))


class PatchEmbedding(_Orientation0):
    """ViT stem: ``[rows, C, H, W] -> [rows, 1 + patches, embed block]``; parameters split
    over the embedding dim (1/d^3) and all-gathered over the pair group when used."""

    def __init__(self, dense: nn.Module, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx, orientation)
        d = self.cube.d
        check_divisible("PatchEmbedding", "embed_size", dense.embed_size, d**3, "split d^3 ways")
        self.patch_size = dense.patch_size
        for name, dim in (("weight", 0), ("bias", 0), ("cls_token", 2), ("pos_embed", 2)):
            self.shard(name, hidden_spec(dim, self.cube))

    def forward(self, x: Tensor) -> Tensor:
        # the hidden-axis ranks use the same images for different embedding blocks
        x = comm.copy_to_group(x, self.cube.group(self.cube.hidden_axis))
        group = self.cube.group(self.cube.pair)
        w, b = comm.all_gather(self.weight, 0, group), comm.all_gather(self.bias, 0, group)
        x = F.conv2d(x, w, b, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = comm.all_gather(self.cls_token, 2, group).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + comm.all_gather(self.pos_embed, 2, group)
        return self._to_layout(x)
