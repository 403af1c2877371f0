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
from gridtrain.parallel.tensor.mode_1d_linear import (
    PM1D,
    CtxRef,
    Linear,
    Linear1DCol,
    Linear1DRow,
    divide,
    in_sharded_region,
    reset_alternation,
    shard_param,
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


def _dense_embedding(
    num: int, dim: int, padding_idx: int | None, dtype
) -> tuple[Tensor, int | None]:
    """nn.Embedding's init (N(0, 1), padding row zeroed) and its normalised padding_idx."""
    if padding_idx is not None:
        if not -num <= padding_idx < num:
            raise ValueError(f"padding_idx must be in [-{num}, {num}), got {padding_idx}")
        padding_idx %= num
    weight = torch.empty(num, dim, dtype=dtype).normal_()
    if padding_idx is not None:
        weight[padding_idx] = 0
    return weight, padding_idx


class Embedding1D(nn.Module):
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
        ctx, n, rank = tp(ctx)
        divide(embedding_dim, n, "embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        weight, self.padding_idx = _dense_embedding(
            num_embeddings, embedding_dim, padding_idx, dtype
        )
        self.weight = shard_param(weight, 1, n, rank, device or ctx.device)
        self._ctx = CtxRef(ctx)

    def forward(self, ids: Tensor) -> Tensor:
        y = F.embedding(ids, self.weight, self.padding_idx)
        return comm.gather_from_group(y, -1, self._ctx.ctx.group(PM1D))


class VocabParallelEmbedding1D(nn.Module):
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
        weight, self.padding_idx = _dense_embedding(
            num_embeddings, embedding_dim, padding_idx, dtype
        )
        self.start, self.end = rank * local, (rank + 1) * local
        pad = self.padding_idx
        self.local_padding_idx = (
            pad - self.start if pad is not None and self.start <= pad < self.end else None
        )
        self.weight = shard_param(weight, 0, n, rank, device or ctx.device)
        self._ctx = CtxRef(ctx)

    def forward(self, ids: Tensor) -> Tensor:
        foreign = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(foreign, 0)
        y = F.embedding(local, self.weight, self.local_padding_idx)
        y = y.masked_fill(foreign.unsqueeze(-1), 0.0)  # also zeroes their weight gradient
        return comm.reduce_from_group(y, self._ctx.ctx.group(PM1D))


def _classifier_weight(
    weight: nn.Parameter | None, want_shape: tuple[int, int], dim: int, name: str, twin: str
) -> nn.Parameter:
    if tuple(weight.shape) != want_shape or get_shard_spec(weight) != ((dim, PM1D),):
        raise ValueError(
            f"tied {name} weight must be this rank's shard {want_shape} split on dim {dim} over "
            f"PARALLEL_1D (a {twin}'s weight), got shape {tuple(weight.shape)} with splits "
            f"{[(d, m.name) for d, m in get_shard_spec(weight)]}"
        )
    return weight


def _dense_classifier_weight(num_classes: int, in_features: int, dtype) -> Tensor:
    weight = torch.empty(num_classes, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=5**0.5)
    return weight


class Classifier1D(nn.Module):
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
        ctx, n, rank = tp(ctx)
        local_in = divide(in_features, n, "in_features")
        device = device or ctx.device
        if weight is None:
            full = _dense_classifier_weight(num_classes, in_features, dtype)
            weight = shard_param(full, 1, n, rank, device)
        else:
            weight = _classifier_weight(
                weight, (num_classes, local_in), 1, "Classifier", "Embedding"
            )
        self.weight = weight
        self.bias = (
            nn.Parameter(torch.zeros(num_classes, dtype=dtype, device=device)) if bias else None
        )
        self._ctx = CtxRef(ctx)

    def forward(self, x: Tensor) -> Tensor:
        group = self._ctx.ctx.group(PM1D)
        y = comm.reduce_from_group(F.linear(comm.split_to_group(x, -1, group), self.weight), group)
        return y if self.bias is None else y + self.bias


class VocabParallelClassifier1D(nn.Module):
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
        ctx, n, rank = tp(ctx)
        local = divide(num_classes, n, "num_classes")
        device = device or ctx.device
        if weight is None:
            full = _dense_classifier_weight(num_classes, in_features, dtype)
            weight = shard_param(full, 0, n, rank, device)
        else:
            weight = _classifier_weight(
                weight, (local, in_features), 0, "VocabParallelClassifier", "VocabParallelEmbedding"
            )
        self.weight = weight
        bias_full = torch.zeros(num_classes, dtype=dtype)
        self.bias = shard_param(bias_full, 0, n, rank, device) if bias else None
        self._ctx = CtxRef(ctx)

    def forward(self, x: Tensor) -> Tensor:
        x = comm.copy_to_group(x, self._ctx.ctx.group(PM1D))
        return mark_vocab_sharded(F.linear(x, self.weight, self.bias))


class PatchEmbedding1D(nn.Module):
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
        ctx, n, rank = tp(ctx)
        divide(embed_size, n, "embed_size")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.patch_size = patch_size
        num_patches = (img_size // patch_size) ** 2
        # dense.PatchEmbedding's draws, in its order
        weight = torch.empty(embed_size, in_chans, patch_size, patch_size, dtype=dtype)
        pos_embed = torch.zeros(1, 1 + num_patches, embed_size, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        nn.init.trunc_normal_(pos_embed, std=0.02)
        device = device or ctx.device
        self.weight = shard_param(weight, 0, n, rank, device)
        self.bias = shard_param(torch.zeros(embed_size, dtype=dtype), 0, n, rank, device)
        self.cls_token = shard_param(torch.zeros(1, 1, embed_size, dtype=dtype), 2, n, rank, device)
        self.pos_embed = shard_param(pos_embed, 2, n, rank, device)
        self._ctx = CtxRef(ctx)

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
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, device or ctx.device, dtype
        )


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
