"""The plain layers gridtrain adds to torch's (``gt.nn.Classifier``, ``gt.nn.PatchEmbedding``):
what the planner leaves whole with no tensor mode, and the dense twin of each mode's
classifier and patch embedding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Classifier(nn.Linear):
    """``logits = x @ weight.T + bias``: an ``nn.Linear`` whose bias starts at zero; pass
    ``weight`` to tie it (e.g. to an embedding's ``[num_classes, in_features]`` weight)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        tied = weight is not None  # then nothing is drawn for the weight (it has an owner)
        super().__init__(in_features, num_classes, bias, "meta" if tied else device, dtype)
        self._tied = tied
        if tied:
            if tuple(weight.shape) != (num_classes, in_features):
                raise ValueError(
                    f"tied classifier weight must be ({num_classes}, {in_features}), "
                    f"got {tuple(weight.shape)}"
                )
            self.weight = weight
            if bias:
                self.bias = nn.Parameter(
                    torch.zeros(num_classes, dtype=dtype, device=weight.device)
                )

    @property
    def num_classes(self) -> int:
        return self.out_features

    def reset_parameters(self) -> None:
        if not getattr(self, "_tied", False):  # a tied weight is reset by its owner
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.zeros_(self.bias)


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
        device=None,
    ):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.img_size, self.patch_size = img_size, patch_size
        self.in_chans, self.embed_size = in_chans, embed_size
        num_patches = (img_size // patch_size) ** 2
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(embed_size, in_chans, patch_size, patch_size, **kw))
        self.bias = nn.Parameter(torch.empty(embed_size, **kw))
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_size, **kw))
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + num_patches, embed_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        nn.init.zeros_(self.bias)
        nn.init.zeros_(self.cls_token)
        nn.init.zeros_(self.pos_embed)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x = F.conv2d(x, self.weight, self.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed
