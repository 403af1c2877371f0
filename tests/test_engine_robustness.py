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


def _nan_run(ctx, bad_steps, fp16, fused=False, defer=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if fused == "sgd":  # momentum buffers that a skipped first step must not create
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    elif fused:  # skips on the device through found_inf (no host sync before the step)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = gt.initialize(model, opt, nn.MSELoss())
    engine.nonfinite.defer = defer  # True: read the flag a step late, as on CUDA
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
    if fused is True:  # the optimizer's own step count skipped the bad steps too
        engine.settle()  # the last window's flag, still pending when deferred
        counts = {int(s["step"]) for s in engine.optimizer.state.values()}
        stepped.append((engine.global_step, counts, engine.nonfinite_in_a_row))
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


# fp32/bf16: the non-finite flag; torch: fp16 autocast + GradScaler, whose agreed overflow
# flag reaches the optimizer as found_inf (an overflow is no non-finite streak: that count
# stays 0 either way)
DEVICE_SKIP = dict(CONFIGS, torch=dict(fp16=dict(mode="torch")))


@pytest.mark.parametrize("name", ["fp32", "bf16", "torch"])
def test_fused_optimizer_skips_on_the_device(name):
    config = dict(DEVICE_SKIP[name], max_nonfinite_steps=3)
    for defer in (False, True):
        results = run_distributed(_nan_run, 2, {1}, name, True, defer, config=config)
        for rank, (stepped, weights, error) in enumerate(results):
            assert error is None, error
            # deferred (CUDA): step() cannot know yet and says True; the step count is
            # corrected at the next step, so after 5 windows 4 steps were taken either way
            told = [True] * 5 if defer else [True, False, True, True, True]
            assert stepped == [*told, (4, {4}, 0)], (rank, defer, stepped)
            assert torch.equal(weights[1], weights[0]), "the device skipped the update"
            assert not torch.equal(weights[2], weights[1]), "the next step updated"
            assert torch.equal(weights[-1], results[0][1][-1]), "replicas stay equal"


def test_a_bad_first_step_is_skipped_on_the_host_before_fused_sgd_has_momentum():
    """Fused SGD makes its momentum buffers with empty_like on its first step, even when
    found_inf then skips it: a bad first window must not reach it (review finding)."""
    for defer in (False, True):
        for stepped, weights, error in run_distributed(
            _nan_run, 2, {0}, "fp32", "sgd", defer, config=dict(max_nonfinite_steps=3)
        ):
            assert error is None and stepped[0] is False, (defer, stepped)
            assert all(torch.isfinite(w).all() and w.abs().max() < 10 for w in weights), weights


def test_settle_counts_a_bad_last_step():
    """Deferred: the last window's flag is read by settle() (the Trainer calls it at each
    epoch's end and before saving its counters), not left uncounted."""
    config = dict(max_nonfinite_steps=3)
    for stepped, _, error in run_distributed(_nan_run, 2, {4}, "fp32", True, True, config=config):
        assert error is None and stepped == [True] * 5 + [(4, {4}, 1)], stepped


def test_deferred_check_still_stops_training():
    config = dict(max_nonfinite_steps=2)
    for stepped, _, error in run_distributed(
        _nan_run, 2, {1, 2, 3}, "fp32", True, True, config=config
    ):
        # bad windows 1 and 2 are read at the steps after them: the third step() raises
        assert stepped == [True, True, True, (1, {1}, 2)], stepped
        assert "max_nonfinite_steps = 2" in error, error


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
