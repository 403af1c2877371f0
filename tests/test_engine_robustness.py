"""The engine under bad numbers and stateful layers: a NaN/inf loss skips the step on every
rank (fp32, bf16, with clipping) and stops after ``max_nonfinite_steps`` in a row; BatchNorm
running statistics follow the first data-parallel replica, as torch DDP's."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from torch import nn

import gridtrain as gt
from gridtrain.engine import NonFiniteLossError


def _nan_run(ctx, bad_steps, fp16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = gt.initialize(model, opt, nn.MSELoss())
    g = torch.Generator().manual_seed(1)
    stepped, weights, error = [], [], None
    try:
        for step in range(5):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            if step in bad_steps and ctx.global_rank == ctx.world_size() - 1:
                loss = loss * float("nan")  # one rank only: every rank must skip
            engine.backward(loss)
            stepped.append(engine.step())
            weights.append(gt.full_state_dict(engine.model)["0.weight"].clone())
    except NonFiniteLossError as err:
        error = str(err)
    return stepped, weights, error


CONFIGS = {
    "fp32": dict(),
    "fp32-clip": dict(clip_grad_norm=1.0),
    "bf16": dict(fp16=dict(mode="bf16")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nonfinite_loss_skips_the_step_on_every_rank(name):
    config = dict(CONFIGS[name], max_nonfinite_steps=3)
    results = run_distributed(_nan_run, 2, {1}, name, config=config)
    for rank, (stepped, weights, error) in enumerate(results):
        assert error is None, error
        assert stepped == [True, False, True, True, True], (rank, stepped)
        assert torch.equal(weights[1], weights[0]), "the skipped step changed nothing"
        assert all(torch.isfinite(w).all() for w in weights), "no NaN reached the weights"
        assert torch.equal(weights[-1], results[0][1][-1]), "replicas stay equal"


def test_consecutive_nonfinite_steps_stop_training():
    config = dict(max_nonfinite_steps=2)
    for stepped, _, error in run_distributed(_nan_run, 2, {1, 2, 3}, "fp32", config=config):
        assert stepped == [True, False], stepped  # the second bad step in a row raises
        assert "max_nonfinite_steps = 2" in error, error


def _bn_run(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    bn = engine.model[1]
    seen = []
    bn.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().mean(0)))
    g = torch.Generator().manual_seed(10 + ctx.global_rank)  # each replica its own data
    after = []
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        engine.zero_grad()
        out = engine(x)
        after.append(bn.running_mean.clone())
        engine.backward(engine.criterion(out, y))
        engine.step()
    return after, seen


def test_batchnorm_statistics_follow_the_first_replica():
    (a0, _), (a1, seen1) = run_distributed(_bn_run, 2)
    for step in range(1, 3):
        # replica 1 starts each forward from replica 0's statistics (broadcast, as DDP), then
        # updates them with its own batch mean (momentum 0.1); float32 arithmetic as BN's
        want = 0.9 * a0[step - 1] + 0.1 * seen1[step]
        torch.testing.assert_close(a1[step], want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(a0[-1], a1[-1]), "the replicas saw different data"
