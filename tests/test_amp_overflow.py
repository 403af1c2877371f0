"""fp16 cannot poison the weights: a long run of overflowing steps stops training with a clear
error (torch and naive alike), and even with the stop turned off the loss scale never falls
below ``min_scale``, so the first finite step after the run writes finite weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.logs import gridtrain_warnings

import gridtrain as gt
from gridtrain.amp import AMP_TYPE
from gridtrain.engine import NonFiniteLossError

D = 8


def _scale(engine) -> float:
    scaler = engine.optimizer.scaler
    return float(scaler.scale if hasattr(scaler, "min_scale") else scaler.get_scale())


def _overflow_run(ctx, bad_steps: int):
    """``bad_steps`` steps whose loss is inf, then finite ones: (steps before it stopped,
    the error, warnings, the scale then, whether every weight is finite)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, 1))
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    x, y = torch.randn(4, D), torch.randn(4, 1)
    done, error = 0, None
    with gridtrain_warnings() as warnings:
        try:
            for step in range(bad_steps + 3):
                engine.zero_grad()
                inputs = x * float("inf") if step < bad_steps else x
                engine.backward(engine.criterion(engine(inputs), y))
                engine.step()
                done += 1
        except NonFiniteLossError as err:
            error = str(err)
    finite = all(torch.isfinite(p).all().item() for p in engine.model.parameters())
    return done, error, list(warnings), _scale(engine), finite


@pytest.mark.parametrize("mode", [AMP_TYPE.TORCH, AMP_TYPE.NAIVE])
def test_a_long_overflow_run_stops_with_a_clear_error(mode):
    config = dict(fp16=dict(mode=mode, max_skipped_steps=40))
    done, error, warnings, _, finite = run_distributed(_overflow_run, 1, 100, config=config)[0]
    assert done == 39, "the 40th skipped step in a row raised"
    assert error is not None and "40" in error and "fp16.max_skipped_steps" in error, error
    assert len(warnings) == 40 - 3, "every skip from the 4th on was logged as it happened"
    assert "skipped on every rank (40 in a row; training stops at 40)" in warnings[-1]
    assert finite


@pytest.mark.parametrize("mode", [AMP_TYPE.TORCH, AMP_TYPE.NAIVE])
def test_the_scale_never_falls_below_min_scale(mode):
    # 200 overflows halve GradScaler's 2**16 to 0 unless something holds it up (~165 suffice)
    config = dict(fp16=dict(mode=mode, max_skipped_steps=0, min_scale=0.5))
    done, error, _, scale, finite = run_distributed(_overflow_run, 1, 200, config=config)[0]
    assert error is None and done == 203, "max_skipped_steps=0: never stops"
    assert scale >= 0.5, scale
    assert finite, "the finite steps after the overflow run wrote finite weights"


def test_the_default_limit_stops_a_run_of_one_hundred():
    config = dict(fp16=dict(mode=AMP_TYPE.TORCH))
    done, error, _, _, _ = run_distributed(_overflow_run, 1, 100, config=config)[0]
    assert error is not None and done == 63, (done, error)
