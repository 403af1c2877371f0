"""1D tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the ``gt.nn`` layer set.

Every layer takes the dense twin's constructor arguments (``dense.py``) plus an
optional ``ctx`` (None: the current context), shards its parameters over the
``PARALLEL_1D`` group and tags them with their shard specs, so full state dicts
have exactly the dense keys and shapes. Weights are drawn as the *dense* tensor
on the CPU in the dense layer's order and then cut, so with the same seed a
model equals its dense twin whatever the layout.

Activation layout: every layer here takes and returns replicated activations,
except column-parallel Linears (``mode_1d_linear``; output sharded unless
``gather_output``) and ``VocabParallelClassifier`` (logits sharded over the
vocabulary, see ``mode_1d_loss``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.sharding import get_shard_spec
from gridtrain.parallel.tensor.common import vocab_block_lookup
from gridtrain.parallel.tensor.mode_1d_linear import (
    PM1D,
    CtxRef,
    Linear,
    Linear1DCol,
    Linear1DRow,
    ShardedFromDense,
    default_device,
    divide,
    in_sharded_region,
    reset_alternation,
    shared_input,
    tp,
)
from gridtrain.parallel.tensor.mode_1d_loss import (
    CrossEntropyLoss,
    VocabShardedLogits,
    accuracy,
    is_vocab_sharded,
    mark_vocab_sharded,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "Classifier",
    "Classifier1D",
    "CrossEntropyLoss",
    "Dropout",
    "Dropout1D",
    "Embedding",
    "Embedding1D",
    "LayerNorm",
    "Linear",
    "Linear1DCol",
    "Linear1DRow",
    "PatchEmbedding",
    "PatchEmbedding1D",
    "VocabParallelClassifier",
    "VocabParallelClassifier1D",
    "VocabParallelEmbedding",
    "VocabParallelEmbedding1D",
    "VocabShardedLogits",
    "accuracy",
    "is_vocab_sharded",
    "mark_vocab_sharded",
    "reset_alternation",
    "shared_input",
    "split_batch",
    "vocab_parallel_cross_entropy",
]


def _padding_idx(padding_idx: int | None, num: int) -> int | None:
    """nn.Embedding's normalised padding_idx."""
    if padding_idx is None:
        return None
    if not -num <= padding_idx < num:
        raise ValueError(f"padding_idx must be in [-{num}, {num}), got {padding_idx}")
    return padding_idx % num


class _Embedding(ShardedFromDense):
    def _dense_init(self) -> dict[str, Tensor]:
        """nn.Embedding's init: N(0, 1), padding row zeroed."""
        weight = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self._dtype).normal_()
        if self.padding_idx is not None:
            weight[self.padding_idx] = 0
        return {"weight": weight}


class Embedding1D(_Embedding):
    """Embedding with the hidden dim split: weight ``[num, dim/n]``; output all-gathered
    ``[..., dim]`` (replicated)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        divide(embedding_dim, n, "embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self._dtype = _padding_idx(padding_idx, num_embeddings), dtype
        self._splits = {"weight": 1}
        self._install(ctx, device)

    def forward(self, ids: Tensor) -> Tensor:
        y = F.embedding(ids, self.weight, self.padding_idx)
        return comm.gather_from_group(y, -1, self._ctx.ctx.group(PM1D))


class VocabParallelEmbedding1D(_Embedding):
    """Embedding with the vocabulary split: weight ``[num/n, dim]``; each rank looks up the
    ids it owns (others read zero) and the partial rows are all-reduced (replicated output).

    Ids outside ``[0, num_embeddings)`` are owned by no rank and read zeros (the dense
    layer raises); they are not checked here, which would cost a device sync per call.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, rank = tp(ctx)
        local = divide(num_embeddings, n, "num_embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self._dtype = _padding_idx(padding_idx, num_embeddings), dtype
        self.start, self.end = rank * local, (rank + 1) * local
        self._splits = {"weight": 0}
        self._install(ctx, device)

    def forward(self, ids: Tensor) -> Tensor:
        y = vocab_block_lookup(
            ids, self.weight, self.start, self.end - self.start, self.padding_idx
        )
        return comm.reduce_from_group(y, self._ctx.ctx.group(PM1D))


class _Classifier(ShardedFromDense):
    """dense.Classifier's parameters: weight drawn unless tied, zero bias."""

    def _setup(
        self, in_features, num_classes, weight, bias, dtype, weight_dim, local_shape, ctx, device
    ):
        self.in_features, self.num_classes = in_features, num_classes
        self._has_bias, self._dtype, self._tied = bias, dtype, weight is not None
        self._splits = {"weight": weight_dim, "bias": None if weight_dim == 1 else 0}
        if weight is not None:
            if tuple(weight.shape) != local_shape or get_shard_spec(weight) != (
                (weight_dim, PM1D),
            ):
                twin = "Embedding" if weight_dim == 1 else "VocabParallelEmbedding"
                raise ValueError(
                    f"tied {type(self).__name__.removesuffix('1D')} weight must be this rank's shard {local_shape} "
                    f"split on dim {weight_dim} over PARALLEL_1D (a {twin}'s weight), got shape "
                    f"{tuple(weight.shape)} with splits "
                    f"{[(d, m.name) for d, m in get_shard_spec(weight)]}"
                )
            self.weight = weight
        self._install(ctx, device)
        if not bias:
            self.register_parameter("bias", None)

    def _dense_init(self) -> dict[str, Tensor]:
        out = {}
        if not self._tied:  # a tied weight belongs to (and is reset by) its embedding
            out["weight"] = torch.empty(self.num_classes, self.in_features, dtype=self._dtype)
            nn.init.kaiming_uniform_(out["weight"], a=math.sqrt(5))
        if self._has_bias:
            out["bias"] = torch.zeros(self.num_classes, dtype=self._dtype)
        return out


class Classifier1D(_Classifier):
    """Classifier with the input features split: weight ``[classes, in/n]`` (ties to an
    ``Embedding``'s weight), bias replicated; replicated input, full (gathered) logits."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        local_in = divide(in_features, n, "in_features")
        self._setup(
            in_features, num_classes, weight, bias, dtype, 1, (num_classes, local_in), ctx, device
        )

    def forward(self, x: Tensor) -> Tensor:
        group = self._ctx.ctx.group(PM1D)
        y = comm.reduce_from_group(F.linear(comm.split_to_group(x, -1, group), self.weight), group)
        return y if self.bias is None else y + self.bias


class VocabParallelClassifier1D(_Classifier):
    """Classifier with the classes split: weight ``[classes/n, in]`` (ties to a
    ``VocabParallelEmbedding``'s weight), bias ``[classes/n]``; replicated input, logits
    sharded over the classes as ``VocabShardedLogits`` (``CrossEntropyLoss`` knows them)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        local = divide(num_classes, n, "num_classes")
        self._setup(
            in_features, num_classes, weight, bias, dtype, 0, (local, in_features), ctx, device
        )

    def forward(self, x: Tensor) -> Tensor:
        x = comm.copy_to_group(x, self._ctx.ctx.group(PM1D))
        return mark_vocab_sharded(F.linear(x, self.weight, self.bias))


class PatchEmbedding1D(ShardedFromDense):
    """ViT stem with the embedding dim split (conv weight/bias, class token and position
    embeddings ``[..., embed/n]``); output all-gathered ``[B, 1 + patches, embed]``."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        divide(embed_size, n, "embed_size")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.patch_size, self.in_chans, self.embed_size = patch_size, in_chans, embed_size
        self.num_patches, self._dtype = (img_size // patch_size) ** 2, dtype
        self._splits = {"weight": 0, "bias": 0, "cls_token": 2, "pos_embed": 2}
        self._install(ctx, device)

    def _dense_init(self) -> dict[str, Tensor]:
        """dense.PatchEmbedding's draws, in its order."""
        e, p, dt = self.embed_size, self.patch_size, self._dtype
        weight = torch.empty(e, self.in_chans, p, p, dtype=dt)
        pos_embed = torch.zeros(1, 1 + self.num_patches, e, dtype=dt)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        nn.init.trunc_normal_(pos_embed, std=0.02)
        return {
            "weight": weight,
            "bias": torch.zeros(e, dtype=dt),
            "cls_token": torch.zeros(1, 1, e, dtype=dt),
            "pos_embed": pos_embed,
        }

    def forward(self, x: Tensor) -> Tensor:
        group = self._ctx.ctx.group(PM1D)
        x = comm.copy_to_group(x, group)  # each rank's channels add to the image gradient
        x = F.conv2d(x, self.weight, self.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return comm.gather_from_group(x, -1, group)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm``, replicated (1d activations around it are replicated)."""

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        ctx: ParallelContext | None = None,
    ):
        ctx, _, _ = tp(ctx)
        device = default_device(device, ctx)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)


class Dropout1D(nn.Module):
    """Dropout drawing from the RNG state the activation layout needs.

    Sharded activations (each rank holds different features) draw from
    ``ctx.fork_rng(PARALLEL_1D)``, distinct per rank; replicated activations draw
    from the default generator, identical on every rank, so replicas stay equal.
    ``sharded=None`` decides at construction: a Dropout built between a column
    Linear and its row Linear (``in_sharded_region``) is sharded; vocab-sharded
    logits are always treated as sharded.
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        sharded: bool | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1], got {p}")
        ctx, _, _ = tp(ctx)
        self.p, self.inplace = p, inplace
        self.sharded = in_sharded_region(ctx) if sharded is None else sharded
        self._ctx = CtxRef(ctx)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.sharded or is_vocab_sharded(x):
            with self._ctx.ctx.fork_rng(PM1D):
                return F.dropout(x, self.p, True, self.inplace)
        return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, sharded={self.sharded}"


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """1d keeps the whole batch on every rank of the tensor group."""
    return x


# canonical names (see layers.py): gt.nn.X under tensor mode "1d"
Embedding = Embedding1D
VocabParallelEmbedding = VocabParallelEmbedding1D
Classifier = Classifier1D
VocabParallelClassifier = VocabParallelClassifier1D
PatchEmbedding = PatchEmbedding1D
Dropout = Dropout1D
