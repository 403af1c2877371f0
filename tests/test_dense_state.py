"""``gt.load_full_state_dict`` right after ``gt.initialize`` holds through the first optimizer
step, and ``gt.full_state_dict`` gives plain tensors of the plain model's dtype, wherever the
optimizer steps a copy of the weights (naive fp16's fp32 masters, ZeRO 1-2's copied rows,
Gemini's host rows) or FSDP2 holds them as DTensors (ZeRO 3)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_lm
from helpers.harness import run_distributed
from helpers.runs import data_rows, engine_step

import gridtrain as gt

FP16 = dict(mode="naive", initial_scale=2.0**4)  # small: the step must not be skipped
CONFIGS = {
    "naive fp16": dict(fp16=FP16),
    "zero1 naive fp16": dict(zero=dict(stage=1), fp16=FP16),
    "zero2 offload": dict(zero=dict(stage=2, offload=True)),
    "zero3": dict(zero=dict(stage=3)),
    "zero3 naive fp16": dict(zero=dict(stage=3), fp16=FP16),
    "gemini": dict(zero=dict(stage=3, offload=True)),
}


def _load_then_step(ctx, target, batch):
    model = tiny_lm.build_model(0, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # the step moves nothing (lr 0)
    engine, *_ = gt.initialize(model, opt, tiny_lm.lm_loss)
    gt.load_full_state_dict(engine.model, target)
    engine_step(engine, *data_rows(batch, ctx), ctx)
    assert not engine.last_step_skipped
    return gt.full_state_dict(engine.model)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loaded_weights_survive_the_first_step(name):
    target = tiny_lm.build_model(1, torch.float32).state_dict()
    batch = tiny_lm.batches(1)[0]
    states = run_distributed(_load_then_step, 2, target, batch, config=CONFIGS[name])
    for state in states:  # every rank has the whole dense state
        assert list(state) == list(target)
        for key, value in state.items():
            assert type(value) is torch.Tensor, f"{key}: {type(value).__name__}"
            assert value.dtype == torch.float32, f"{key}: {value.dtype}, the plain model's fp32"
            # exact: a load and a gather are copies, and AdamW at lr 0 leaves weights as they
            # are; stale masters written back by the step would restore the seed-0 weights
            torch.testing.assert_close(value, target[key], rtol=0, atol=0, msg=key)
