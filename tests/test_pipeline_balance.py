"""Pipeline stages are balanced for every kind of model: the same two-block network built from
``gt.nn`` layers in an ``nn.Sequential``, from plain torch layers in an ``nn.Sequential``, and
as a plain model whose forward chains an embedding, an ``nn.ModuleList`` of blocks, a norm
and a head. Under ``pipeline=2`` each rank holds at most 0.6 of the parameters (cut by layer
count, the first stage would hold 0.94), every parameter is on a stage, ``print(engine.plan)``
shows the stage table, and the losses and weights equal one process's.

The Hugging Face families are held to the same share in ``test_hf_parity.check_layout``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.runs import Ints, batches, engine_run, reference_run
from torch import nn

import gridtrain as gt

VOCAB, D, STEPS, BATCH, SEQ, MICRO = 16, 16, 3, 8, 6, 4
STAGE_SHARE = 0.6  # the bound for a 2-block model whose embedding and head are small


class Block(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.norm = layers.LayerNorm(D)
        self.up, self.down = layers.Linear(D, 4 * D), layers.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ChainLM(nn.Module):
    """Nothing but its forward says what its layers are."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(nn) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _sequential(layers) -> nn.Module:
    blocks = [Block(layers) for _ in range(2)]
    return nn.Sequential(
        layers.Embedding(VOCAB, D), *blocks, layers.LayerNorm(D), layers.Linear(D, VOCAB)
    )


MODELS = {
    "gt.nn Sequential": lambda: _sequential(gt.nn),
    "torch Sequential": lambda: _sequential(nn),
    "ModuleList blocks": ChainLM,
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().double()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def data():
    return batches(STEPS, Ints(VOCAB, (BATCH, SEQ)), Ints(VOCAB, (BATCH, SEQ)), seed=1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def train_dense(kind: str):
    ref = reference_run(lambda: build(kind), data(), loss_fn, _sgd, grad_steps=0)
    return ref.losses, ref.state


def _train_each(ctx):
    out = {}
    for kind in MODELS:
        run = engine_run(
            ctx,
            partial(build, kind),
            data(),
            loss_fn,
            _sgd,
            grad_steps=0,
            probe=lambda e: {n for n, _ in e.model.named_parameters()},
        )
        out[kind] = dict(
            losses=run.losses, held=run.held, names=run.probed, plan=run.plan, full=run.state
        )
    return out


def test_every_kind_of_model_gets_balanced_stages():
    config = dict(parallel=dict(pipeline=2), num_microbatches=MICRO)
    ranks = run_distributed(_train_each, 2, config=config, timeout=300)
    for kind in MODELS:
        d_losses, d_state = train_dense(kind)
        total = sum(p.numel() for p in build(kind).parameters())
        names = [r[kind]["names"] for r in ranks]
        assert names[0] | names[1] == {n for n, _ in build(kind).named_parameters()}, kind
        for stage, r in enumerate(ranks):
            got = r[kind]
            share = got["held"] / total
            print(f"\nSTAGES {kind}: stage {stage} holds {share:.3f} of {total} parameters")
            assert share <= STAGE_SHARE, (kind, stage, share)
            assert "pipeline stages: 2" in got["plan"] and f"{got['held']:,}" in got["plan"], got[
                "plan"
            ]
            # float64; micro-batches only reorder the gradient sums
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(d_losses), rtol=1e-12, atol=1e-12
            )
            for key, want in d_state.items():
                torch.testing.assert_close(
                    got["full"][key], want, rtol=1e-12, atol=1e-12, msg=f"{kind} {key}"
                )
