"""``gridtrain estimate`` cuts the pipeline where the engine cuts it: the same ``partition`` on the
same layer costs (parameters, and compute that leaves out an embedding's lookup), so each
estimated stage holds the layers ``engine.plan``'s stage table gives that stage.

The model's untied head over a wide vocabulary is where the two differ unless the costs are
the engine's: by parameters alone the embedding weighs as much as the head, by compute it
weighs nothing, and the balanced cut moves three blocks."""

from __future__ import annotations

import torch
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.config import Config
from gridtrain.estimate import ModelSpec, Scenario, estimate, get_device
from gridtrain.estimate.skeleton import Decoder

SPEC = ModelSpec(
    "wide-vocab", layers=4, hidden=32, heads=4, vocab=2048, seq_len=16, tied=False
)  # fmt: skip


def _engine_stages(ctx, spec: ModelSpec):
    torch.manual_seed(0)
    model = Decoder(spec)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return [r.chunks for r in engine.plan.stages.rows]


def _layers(chunks) -> tuple[bool, int, bool]:
    names = [n for chunk in chunks for n in chunk]
    return "embed" in names, sum(n[1:].isdigit() for n in names), "head" in names


def test_estimated_stages_are_the_engines():
    config = dict(parallel=dict(pipeline=dict(size=2, partition="balanced")), num_microbatches=2)
    engine = run_distributed(_engine_stages, 2, SPEC, config=config)[0]
    sc = Scenario.from_config(Config.from_dict(config), world=2)
    est = estimate(SPEC, sc, get_device("a100-80g"))
    got = [(s.layers.embed, s.layers.blocks, s.layers.head) for s in est.stages]
    assert got == [_layers(chunks) for chunks in engine]
    assert got[0][1] > got[1][1], f"the embedding computes nothing: stage 0 takes more, {got}"
