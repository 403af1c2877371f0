"""``gt.initialize(model, optimizer, criterion)`` with neither a dataloader nor ``example_inputs``
trains in every layout: the planner (and chunked_loss's head finding) builds its trace input
from the model's entry layer. Each layout gives one process's losses while each rank holds
only its share."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.models import TinyTransformer
from helpers.runs import (
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    token_batches,
)
from torch import nn

import gridtrain as gt

STEPS, BATCH, SEQ, VOCAB = 2, 8, 16, 64


class GtBlock(nn.Module):
    """Written with gt.nn layers and no split hints; attention through gt.nn.attention."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.head_dim = d // heads
        self.norm = gt.nn.LayerNorm(d)
        self.qkv, self.out = gt.nn.Linear(d, 3 * d), gt.nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # head-major fused qkv: a column split keeps heads
        a = gt.nn.attention(q, k, v, causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, -1))


class GtLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(GtBlock(d), GtBlock(d))
        self.norm, self.head = gt.nn.LayerNorm(d), gt.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.tok(ids))))


MODELS = {"plain": lambda: TinyTransformer(vocab=VOCAB, seq=SEQ), "gt.nn": GtLM}
# name: (world, config, model, share of blocks.1's output projection each rank holds)
LAYOUTS = {
    "1d2": (*layout("1d2"), "plain", 1 / 2),
    "1d2-gt.nn": (*layout("1d2"), "gt.nn", 1 / 2),
    "2d4": (*layout("2d4"), "plain", 1 / 4),
    "2.5d8": (*layout("2.5d8"), "gt.nn", 1 / 4),
    "3d8": (*layout("3d8"), "plain", 1 / 8),
    "sequence2": (*layout("sequence2"), "gt.nn", 1.0),
    "1d2-pp2": (*layout("1d2-pp2", num_microbatches=2), "plain", 1 / 2),
    "dp2-chunked_loss": (2, dict(chunked_loss=dict(chunk_tokens=32)), "plain", 1.0),
    "dp2-1d2-zero2": (
        4,
        dict(parallel=dict(tensor=dict(size=2, mode="1d")), zero=dict(stage=2)),
        "gt.nn",
        1 / 2,
    ),
}
OUT_PROJ = {"plain": "blocks.1.attn.out.weight", "gt.nn": "blocks.1.out.weight"}


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _model(model_name):
    return seeded(MODELS[model_name], seed=0)


def _train(ctx, batches, model_name):
    build = lambda: _model(model_name)  # noqa: E731
    return engine_run(ctx, build, batches, lm_loss, _adamw)  # no example, no dataloader


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_initialize_needs_no_example_input(name):
    world, config, model_name, share = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    dense_loss = dense_lm_loss
    ref = reference_run(lambda: _model(model_name), batches, dense_loss, _adamw)
    results = run_distributed(_train, world, batches, model_name, config=config, timeout=300)
    # each data rank reports its rows' mean: their mean is the dense loss; float64: layouts
    # only reorder sums (measured <= 1e-15 relative)
    assert global_losses(results) == pytest.approx(ref.losses, rel=1e-12), name
    for rank, run in enumerate(results):
        plan, held = run.plan, run.shares
        if OUT_PROJ[model_name] in held:  # (pipeline: on the last stage only)
            assert held[OUT_PROJ[model_name]] == pytest.approx(share), (name, rank, held)
        assert plan.startswith("layout: "), plan
