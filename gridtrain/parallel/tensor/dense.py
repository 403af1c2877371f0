"""The layer set with no tensor parallelism: plain torch modules, and the dense twins.

Every tensor mode implements these names with the same constructor arguments;
its layers' full state dicts have exactly the keys and shapes of the ones here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext

Linear = nn.Linear
Embedding = nn.Embedding
VocabParallelEmbedding = nn.Embedding
LayerNorm = nn.LayerNorm
Dropout = nn.Dropout
CrossEntropyLoss = nn.CrossEntropyLoss


class Classifier(nn.Module):
    """``logits = x @ weight.T + bias``; pass ``weight`` to tie it (e.g. to an embedding)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(num_classes, in_features, dtype=dtype))
            nn.init.kaiming_uniform_(weight, a=5**0.5)
        elif tuple(weight.shape) != (num_classes, in_features):
            raise ValueError(
                f"tied classifier weight must be ({num_classes}, {in_features}), got {tuple(weight.shape)}"
            )
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(num_classes, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


VocabParallelClassifier = Classifier


class PatchEmbedding(nn.Module):
    """ViT stem: conv patches, a class token in front, learned position embeddings.

    ``[B, C, H, W] -> [B, 1 + (H/p)*(W/p), embed_size]``.
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.patch_size = patch_size
        num_patches = (img_size // patch_size) ** 2
        self.weight = nn.Parameter(
            torch.empty(embed_size, in_chans, patch_size, patch_size, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.zeros(embed_size, dtype=dtype))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_size, dtype=dtype))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, embed_size, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x = F.conv2d(x, self.weight, self.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed


def accuracy(
    logits: Tensor, labels: Tensor, ctx: ParallelContext | None = None
) -> tuple[Tensor, Tensor]:
    """(correct, total) over this data-parallel rank's batch, as 0-d tensors."""
    correct = (logits.argmax(dim=-1) == labels).sum()
    return correct, torch.tensor(labels.numel(), device=labels.device)


def split_batch(x: Tensor, ctx: ParallelContext) -> Tensor:
    """No tensor parallelism: every rank of the tensor group keeps the whole batch."""
    return x
