"""3D tensor parallelism (Bian et al. 2021, "Maximizing Parallelism in Distributed Training
for Huge Neural Networks"): the layer set on a d x d x d cube.

Layout (axes A, B, C and orientations: see ``mode_3d_ops``), rank (a, f, g):

* activations ``[batch, ..., hidden]``: rows ``a*d + g`` of ``d*d``, hidden block f;
* ``Linear`` weight ``W[in, out]`` block (in f, out g), split again over A: nn.Linear's
  ``[out/d^2, in/d]``; all-gathered over A, the input all-gathered over G, the
  product reduce-scattered over F (the paper's Y = X W; backward: gather dY,
  reduce-scatter dX and dW, which comm's all_gather/reduce_scatter give as adjoints);
* biases, LayerNorm, embedding and classifier parameters: split over the hidden
  axis and then over the pair group A x G of the ranks that use the same block;
* every rank holds 1/d^3 = 1/T of each sharded parameter; only ``Classifier``'s bias
  is replicated when ``num_classes`` is not divisible by d^3.

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
from gridtrain.parallel.sharding import get_shard_spec
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor.common import (
    check_divisible,
    layer_norm_width,
    normalize_over_group,
    vocab_block_lookup,
)
from gridtrain.parallel.tensor.mode_3d_loss import CrossEntropyLoss, accuracy
from gridtrain.parallel.tensor.mode_3d_ops import (
    AXIS_A,
    PAIR,
    Cube,
    as_shard,
    cube_now,
    hidden_spec,
    linear_3d,
    reset_orientation,
    shard_param,
    split_batch,
    swap_orientation,
    take_orientation,
)
from gridtrain.parallel.tensor.vocab_loss import VOCAB_PARALLEL_TAG

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
    "reset_orientation",
    "split_batch",
]


class Linear(nn.Module):
    """``y = x W^T + b`` on the cube; flips the orientation for the layers built after it."""

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
        cube = self.cube = cube_now(ctx)
        d = cube.d
        check_divisible("Linear", "in_features", in_features, d, "split over the hidden axis")
        check_divisible("Linear", "out_features", out_features, d**2, "split over G, then over A")
        if bias:
            check_divisible(
                "Linear", "out_features", out_features, d**3, "the bias is split d^3 ways"
            )
        self.in_features, self.out_features = in_features, out_features
        twin = nn.Linear(in_features, out_features, bias, dtype=dtype)
        spec = ((0, cube.row), (0, AXIS_A), (1, cube.feat))
        self.weight = shard_param(twin.weight, spec, cube, device)
        if bias:
            self.bias = shard_param(twin.bias, ((0, cube.row), (0, PAIR[cube.feat])), cube, device)
        else:
            self.register_parameter("bias", None)
        take_orientation(cube.ctx, flip=True)

    def forward(self, x: Tensor) -> Tensor:
        x = as_shard("Linear", x, self.in_features, self.cube)
        return linear_3d(x, self.weight, self.bias, self.cube)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.cube}"


class LayerNorm(nn.Module):
    """LayerNorm over a hidden dim split over F (statistics all-reduced over F)."""

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
        cube = self.cube = cube_now(ctx)
        self.hidden, self.eps = layer_norm_width(normalized_shape), eps
        by = cube.d**3 if elementwise_affine else cube.d
        check_divisible(
            "LayerNorm", "normalized_shape", self.hidden, by, "hidden blocks x parameter split"
        )
        twin = nn.LayerNorm(self.hidden, eps, elementwise_affine, bias, dtype=dtype)
        spec = hidden_spec(0, cube)
        self.weight = shard_param(twin.weight, spec, cube, device) if elementwise_affine else None
        self.bias = shard_param(twin.bias, spec, cube, device) if twin.bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        cube = self.cube
        x = as_shard("LayerNorm", x, self.hidden, cube)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = normalize_over_group(xf, self.hidden, self.eps, cube.group(cube.feat)).to(x.dtype)
        if self.weight is not None:
            y = y * comm.all_gather(self.weight, 0, cube.group(cube.pair))
        if self.bias is not None:
            y = y + comm.all_gather(self.bias, 0, cube.group(cube.pair))
        return y

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, {self.cube}"


class _Orientation0(nn.Module):
    """Layers at the model's edges compute in orientation 0 and convert when built at 1."""

    def _setup(self, ctx: ParallelContext | None) -> Cube:
        built = cube_now(ctx)
        self.flip = built.orientation == 1
        self.cube = Cube.of(built.ctx, 0)
        return self.cube

    def _to_built(self, y: Tensor) -> Tensor:
        return swap_orientation(y, self.cube) if self.flip else y

    def _from_built(self, name: str, x: Tensor, width: int) -> Tensor:
        if self.flip:
            if x.shape[-1] != width // self.cube.d:
                raise ValueError(
                    f"{name}: input's last dim is {x.shape[-1]}, expected this rank's hidden "
                    f"block of {width // self.cube.d}"
                )
            x = swap_orientation(x, self.cube.flipped())
        return as_shard(name, x, width, self.cube)


class Embedding(_Orientation0):
    """Token embedding with the embedding dim split (1/d^3 per rank); output laid out like activations."""

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
        cube = self._setup(ctx)
        check_divisible("Embedding", "embedding_dim", embedding_dim, cube.d**3, "split d^3 ways")
        twin = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        self.weight = shard_param(twin.weight, hidden_spec(1, cube), cube, device)

    def forward(self, ids: Tensor) -> Tensor:
        w = comm.all_gather(self.weight, 1, self.cube.group(self.cube.pair))
        return self._to_built(F.embedding(ids, w, self.padding_idx))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.cube}"


class VocabParallelEmbedding(_Orientation0):
    """Embedding with the vocabulary split over C (then A) and the dim over B.

    Each rank gathers its batch block's token ids, looks up its vocabulary block
    and reduce-scatters the partial embeddings back to its rows.
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
        cube = self._setup(ctx)
        name = "VocabParallelEmbedding"
        check_divisible(
            name, "num_embeddings", num_embeddings, cube.d**2, "vocab split over C then A"
        )
        check_divisible(name, "embedding_dim", embedding_dim, cube.d, "hidden blocks")
        twin = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = twin.padding_idx
        spec = ((0, cube.row), (0, AXIS_A), (1, cube.feat))
        self.weight = shard_param(twin.weight, spec, cube, device)

    def forward(self, ids: Tensor) -> Tensor:
        cube, n = self.cube, self.num_embeddings // self.cube.d
        ids = comm.all_gather_raw(ids, 0, cube.group(cube.row))  # the whole batch block a
        w = comm.all_gather(self.weight, 0, cube.group(AXIS_A))
        out = vocab_block_lookup(ids, w, cube.rank(cube.row) * n, n, self.padding_idx)
        return self._to_built(comm.reduce_scatter(out, 0, cube.group(cube.row)))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.cube}"


def _tied(name: str, weight: nn.Parameter, spec, shape: tuple[int, ...], dense_shape) -> None:
    if get_shard_spec(weight) != spec or tuple(weight.shape) != shape:
        raise ValueError(
            f"{name}: a tied weight must be the matching 3D embedding's weight of dense shape "
            f"{dense_shape}; got local shape {tuple(weight.shape)} with shard spec "
            f"{get_shard_spec(weight)}"
        )


class Classifier(_Orientation0):
    """``logits = x W^T + b`` gathered: rows (a, c) of ``split_batch`` with every class.

    ``weight`` is split like ``Embedding``'s (tie by passing it). The bias is split
    d^3 ways when ``num_classes`` allows, else replicated.
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
        cube = self._setup(ctx)
        d = cube.d
        check_divisible("Classifier", "in_features", in_features, d**3, "split d^3 ways")
        self.in_features, self.num_classes = in_features, num_classes
        spec = hidden_spec(1, cube)
        if weight is None:
            twin = dense.Classifier(in_features, num_classes, bias=False, dtype=dtype)
            weight = shard_param(twin.weight, spec, cube)
        else:
            shape = (num_classes, in_features // d**3)
            _tied("Classifier", weight, spec, shape, (num_classes, in_features))
        self.weight = weight
        self.split_bias = num_classes % d**3 == 0
        if not bias:
            self.register_parameter("bias", None)
        elif self.split_bias:
            self.bias = shard_param(
                torch.zeros(num_classes, dtype=dtype), hidden_spec(0, cube), cube
            )
        else:
            self.bias = nn.Parameter(torch.zeros(num_classes, dtype=dtype, device=cube.ctx.device))

    def forward(self, x: Tensor) -> Tensor:
        cube = self.cube
        x = self._from_built("Classifier", x, self.in_features)
        partial = x @ comm.all_gather(self.weight, 1, cube.group(cube.pair)).t()
        # one logit tensor, replicated over B: the loss's gradient passes unchanged
        logits = comm.reduce_from_group(partial, cube.group(cube.feat))
        if self.bias is None:
            return logits
        if self.split_bias:
            bias = comm.all_gather(self.bias, 0, cube.group(cube.pair))
            bias = comm.gather_from_group(bias, 0, cube.group(cube.feat))
        else:  # every batch block adds the same bias: sum their gradients
            bias = comm.copy_to_group(self.bias, cube.group(cube.pair))
        return logits + bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, {self.cube}"


class VocabParallelClassifier(_Orientation0):
    """``logits = x W^T + b`` as a 3D Linear: rows (a, b), vocab block c (never gathered).

    ``weight`` is split like ``VocabParallelEmbedding``'s (tie by passing it). Pair
    with this mode's ``CrossEntropyLoss``/``accuracy``, which recognise the output
    (or a view of it) as vocab-parallel and re-cut the labels to its rows.
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
        cube = self._setup(ctx)
        d, name = cube.d, "VocabParallelClassifier"
        check_divisible(name, "in_features", in_features, d, "hidden blocks")
        check_divisible(name, "num_classes", num_classes, d**3 if bias else d**2, "vocab blocks")
        self.in_features, self.num_classes = in_features, num_classes
        spec = ((0, cube.row), (0, AXIS_A), (1, cube.feat))
        if weight is None:
            twin = dense.Classifier(in_features, num_classes, bias=False, dtype=dtype)
            weight = shard_param(twin.weight, spec, cube)
        else:
            shape = (num_classes // d**2, in_features // d)
            _tied(name, weight, spec, shape, (num_classes, in_features))
        self.weight = weight
        if bias:
            spec = ((0, cube.row), (0, PAIR[cube.feat]))
            self.bias = shard_param(torch.zeros(num_classes, dtype=dtype), spec, cube)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        x = self._from_built("VocabParallelClassifier", x, self.in_features)
        logits = linear_3d(x, self.weight, self.bias, self.cube)
        setattr(logits, VOCAB_PARALLEL_TAG, True)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, {self.cube}"


class PatchEmbedding(_Orientation0):
    """ViT stem: ``[rows, C, H, W] -> [rows, 1 + patches, embed block]``.

    Conv filters, bias, class token and position embeddings are split over the
    embedding dim (1/d^3) and all-gathered over the pair group when used.
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
        cube = self._setup(ctx)
        check_divisible("PatchEmbedding", "embed_size", embed_size, cube.d**3, "split d^3 ways")
        twin = dense.PatchEmbedding(img_size, patch_size, in_chans, embed_size, dtype=dtype)
        self.patch_size = patch_size
        self.weight = shard_param(twin.weight, hidden_spec(0, cube), cube)
        self.bias = shard_param(twin.bias, hidden_spec(0, cube), cube)
        self.cls_token = shard_param(twin.cls_token, hidden_spec(2, cube), cube)
        self.pos_embed = shard_param(twin.pos_embed, hidden_spec(2, cube), cube)

    def forward(self, x: Tensor) -> Tensor:
        # the B ranks use the same images for different embedding blocks: sum their gradients
        x = comm.copy_to_group(x, self.cube.group(self.cube.feat))
        group = self.cube.group(self.cube.pair)
        w, b = comm.all_gather(self.weight, 0, group), comm.all_gather(self.bias, 0, group)
        x = F.conv2d(x, w, b, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = comm.all_gather(self.cls_token, 2, group).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + comm.all_gather(self.pos_embed, 2, group)
        return self._to_built(x)


class Dropout(nn.Dropout):
    """Dropout on 3D activations: every rank holds a different piece, so a distinct mask."""

    def __init__(
        self, p: float = 0.5, inplace: bool = False, *, ctx: ParallelContext | None = None
    ):
        super().__init__(p, inplace)
        self.cube = Cube.of(ctx or get_context())

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        with self.cube.ctx.fork_rng(ParallelMode.TENSOR):
            return super().forward(x)
