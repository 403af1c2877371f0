"""Tiny models and a dense reference trainer shared by the pipeline tests."""

from __future__ import annotations

import torch
from torch import nn

import gridtrain as gt

VOCAB, HIDDEN, SEQ = 16, 8, 3


def tied_lm(depth: int = 8) -> nn.Sequential:
    """Embedding, ``depth`` Linear/Tanh layers, and a classifier tied to the embedding, from
    ``gt.nn`` (plain modules: the tensor mode, if any, is applied by ``gt.initialize``).

    Layer count ``depth + 2`` is at least 8 so pipeline 4 x 2 chunks has a layer per part.
    """
    layers = gt.nn
    emb = layers.VocabParallelEmbedding(VOCAB, HIDDEN)
    body: list[nn.Module] = []
    for i in range(depth):
        body.append(layers.Linear(HIDDEN, HIDDEN) if i % 2 == 0 else nn.Tanh())
    head = layers.VocabParallelClassifier(HIDDEN, VOCAB, weight=emb.weight)
    return nn.Sequential(emb, *body, head)


class LMLoss(nn.Module):
    """Token cross entropy on [B, S, V] logits through the mode's CrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.ce = gt.nn.CrossEntropyLoss()

    def forward(self, logits, targets):
        return self.ce(logits.flatten(0, -2), targets.flatten())


def dense_model(seed: int = 0, **kw) -> nn.Sequential:
    """The reference model (the same plain modules, seeded)."""
    torch.manual_seed(seed)
    return tied_lm(**kw)


def batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(VOCAB, (batch, SEQ), generator=g),
            torch.randint(VOCAB, (batch, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with different settings, to prove the optimizer rebind keeps them."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [dict(params=decay, weight_decay=0.01), dict(params=rest, lr=0.05)]


def train_dense(data, clip: float = 0.0, accumulation: int = 1):
    """Losses and state dict of the dense model trained on whole batches (SGD, momentum)."""
    model = dense_model()
    opt = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    crit = LMLoss()
    losses, grads = [], None
    for step in range(0, len(data), accumulation):
        opt.zero_grad()
        window = data[step : step + accumulation]
        total = 0.0
        for x, y in window:
            loss = crit(model(x), y)
            (loss / accumulation).backward()
            total += loss.item()
            losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return losses, model.state_dict(), grads


def data_slice(x: torch.Tensor, ctx) -> torch.Tensor:
    """This data-parallel rank's rows of a global batch."""
    d, n = ctx.local_rank(gt.ParallelMode.DATA), ctx.world_size(gt.ParallelMode.DATA)
    return x.chunk(n)[d]
