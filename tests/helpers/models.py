"""Models the tests share, small enough for CPU: plain PyTorch, except ``tied_lm`` (``gt.nn``
layers, which are plain modules until ``gt.initialize`` gives them a mode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gridtrain as gt


class MLP(nn.Module):
    """Two Linear layers (8 -> 16 -> 4) and a ReLU: under 1d the engine cuts ``fc1`` by
    column and ``fc2`` by row (its bias replicated)."""

    D_IN, HIDDEN, D_OUT = 8, 16, 4

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(self.D_IN, self.HIDDEN)
        self.fc2 = nn.Linear(self.HIDDEN, self.D_OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def mlp(seed: int = 0) -> MLP:
    """The MLP from ``seed`` (float32)."""
    torch.manual_seed(seed)
    return MLP()


def momentum_sgd(model_or_params, lr: float = 0.1):
    """SGD with momentum 0.9 (no weight decay): each update is the gradient history."""
    params = (
        model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    )
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def classifier_net(hidden: int = 32, dropout: float = 0.0, d_in: int = 16) -> nn.Sequential:
    """Linear, GELU, (Dropout), Linear, LayerNorm, Classifier (8 classes), from ``gt.nn``:
    every parameter kind of a block, as a Sequential a pipeline can cut."""
    layers: list[nn.Module] = [gt.nn.Linear(d_in, hidden), nn.GELU()]
    if dropout:
        layers.append(gt.nn.Dropout(dropout))
    layers += [gt.nn.Linear(hidden, d_in), gt.nn.LayerNorm(d_in), gt.nn.Classifier(d_in, 8)]
    return nn.Sequential(*layers)


def adamw_halving(model: nn.Module, lr: float = 1e-2):
    """AdamW (weight decay 0.1) and an LR halved after every step (state to resume)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def tied_lm(depth: int = 8, vocab: int = 16, hidden: int = 8) -> nn.Sequential:
    """Embedding, ``depth`` Linear/Tanh layers, and a classifier tied to the embedding, from
    ``gt.nn`` (plain modules: the tensor mode, if any, is applied by ``gt.initialize``).
    ``depth + 2`` layers, at least 8 so that pipeline 4 x 2 chunks has a layer per part."""
    emb = gt.nn.VocabParallelEmbedding(vocab, hidden)
    body: list[nn.Module] = []
    for i in range(depth):
        body.append(gt.nn.Linear(hidden, hidden) if i % 2 == 0 else nn.Tanh())
    head = gt.nn.VocabParallelClassifier(hidden, vocab, weight=emb.weight)
    return nn.Sequential(emb, *body, head)


class LMLoss(nn.Module):
    """Token cross entropy on [B, S, V] logits through ``gt.nn.CrossEntropyLoss``."""

    def __init__(self):
        super().__init__()
        self.ce = gt.nn.CrossEntropyLoss()

    def forward(self, logits, targets):
        return self.ce(logits.flatten(0, -2), targets.flatten())


def two_groups(model: nn.Module) -> list[dict]:
    """Weights (weight decay 0.01) and the rest (lr 0.05): settings the optimizer keeps."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [dict(params=decay, weight_decay=0.01), dict(params=rest, lr=0.05)]


class Attention(nn.Module):
    """Causal self-attention over whichever heads this rank's projections hold.

    ``fused``: one ``qkv`` Linear laid out ``[q | k | v]`` (needs ``packed_colwise`` under
    1d, as Hugging Face's GPT-2); else separate ``q``, ``k``, ``v`` projections.
    """

    def __init__(self, hidden: int, heads: int, fused: bool = False):
        super().__init__()
        self.head_dim = hidden // heads
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, fused: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, fused)
        self.fc, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Embeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a final norm and an LM head
    (tied to the token embedding when ``tie``). ``pipeline_layers()`` lists the cut points."""

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        heads: int = 4,
        layers: int = 2,
        seq: int = 16,
        tie: bool = False,
        fused: bool = False,
    ):
        super().__init__()
        self.embed = Embeddings(vocab, hidden, seq)
        self.blocks = nn.ModuleList(Block(hidden, heads, fused) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.tok.weight

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.norm, self.head]

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
