"""1D embeddings (vocabulary- or dim-split) and the ViT patch stem, made from dense ones.

Every layer here takes ids or images and returns replicated activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.tensor.base import ShardedModule, check_divisible
from gridtrain.parallel.tensor.mode_1d.linear import PM1D
from gridtrain.parallel.tensor.vocab import vocab_block_lookup


class Embedding1D(ShardedModule):
    """``embedding_colwise``: the embedding dim split, weight ``[num, dim/n]``; output
    all-gathered ``[..., dim]`` (replicated)."""

    def __init__(self, dense: nn.Embedding, ctx=None):
        super().__init__(dense, ctx)
        n = self.ctx.world_size(PM1D)
        check_divisible("Embedding1D", "embedding_dim", dense.embedding_dim, n, "1d size")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        self.shard("weight", [(1, PM1D)])

    def forward(self, ids: Tensor) -> Tensor:
        y = F.embedding(ids, self.weight, self.padding_idx)
        return comm.gather_from_group(y, -1, self.ctx.group(PM1D))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dim split"


class VocabParallelEmbedding1D(ShardedModule):
    """``embedding_rowwise``: the vocabulary split, weight ``[num/n, dim]``; each rank looks
    up the ids it owns (others read zero) and the partial rows are all-reduced.

    Ids outside ``[0, num_embeddings)`` are owned by no rank and read zeros (the dense
    layer raises); they are not checked here, which would cost a device sync per call.
    """

    def __init__(self, dense: nn.Embedding, ctx=None):
        super().__init__(dense, ctx)
        n, rank = self.ctx.world_size(PM1D), self.ctx.local_rank(PM1D)
        check_divisible(
            "VocabParallelEmbedding1D", "num_embeddings", dense.num_embeddings, n, "1d size"
        )
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.padding_idx = dense.padding_idx
        local = dense.num_embeddings // n
        self.start, self.end = rank * local, (rank + 1) * local
        self.shard("weight", [(0, PM1D)])

    def forward(self, ids: Tensor) -> Tensor:
        y = vocab_block_lookup(
            ids, self.weight, self.start, self.end - self.start, self.padding_idx
        )
        return comm.reduce_from_group(y, self.ctx.group(PM1D))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocab [{self.start}, {self.end})"


class PatchEmbedding1D(ShardedModule):
    """ViT stem with the embedding dim split (conv weight/bias, class token and position
    embeddings ``[..., embed/n]``); output all-gathered ``[B, 1 + patches, embed]``."""

    def __init__(self, dense: nn.Module, ctx=None):
        super().__init__(dense, ctx)
        n = self.ctx.world_size(PM1D)
        check_divisible("PatchEmbedding1D", "embed_size", dense.embed_size, n, "1d size")
        self.patch_size = dense.patch_size
        for name, dim in (("weight", 0), ("bias", 0), ("cls_token", 2), ("pos_embed", 2)):
            self.shard(name, [(dim, PM1D)])

    def forward(self, x: Tensor) -> Tensor:
        group = self.ctx.group(PM1D)
        x = comm.copy_to_group(x, group)  # each rank's channels add to the image gradient
        x = F.conv2d(x, self.weight, self.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return comm.gather_from_group(x, -1, group)
