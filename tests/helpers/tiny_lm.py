"""The README's training script in miniature: a plain-PyTorch transformer LM, its loss, its
optimizer and LR scheduler, and its batches. Nothing here knows about gridtrain but the loss
(``gt.nn.CrossEntropyLoss`` takes logits of any layout): its attention is torch's
``scaled_dot_product_attention``, which the engine runs as ring attention under sequence
parallelism, so the one script serves the whole layout matrix.

Dimensions are tiny and chosen so that every layout divides them: vocab 64, width 16 and
4 heads split over 2 (1d, 2d, 2.5d, 3d), 8 (3d's weights) and 4 (2d's weights); a batch of
8 x 8 tokens splits over data, 2d/2.5d/3d rows, sequence halves and pipeline micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers.runs import lm_loss, token_batches  # noqa: F401 - lm_loss: the script's loss

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 64, 16, 4, 2, 8, 8
LR, GAMMA = 1e-2, 0.8


class Block(nn.Module):
    """Pre-norm attention (q/k/v/o) and MLP. The head size comes from the configuration, not
    from activations: under 2d/2.5d/3d the hidden dimension arrives split."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            t(h).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab=VOCAB, d=D, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.emb(ids))))


def build_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> LM:
    """The model from ``seed`` (float64: layouts then differ only by summation order)."""
    torch.manual_seed(seed)
    return LM().to(dtype)


def optimizer_and_scheduler(model: nn.Module):
    """AdamW (state shaped like every parameter) and a per-step LR decay (state to resume)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (token ids, next-token labels)."""
    return token_batches(steps, BATCH, SEQ, VOCAB, seed=seed)


def dense_numel() -> int:
    """Elements of the dense model's parameters."""
    return sum(p.numel() for p in LM().parameters())
