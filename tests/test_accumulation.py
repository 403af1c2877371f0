"""Gradient accumulation: N micro-steps equal one optimizer step on the N-times-larger batch."""

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import MLP, mlp, momentum_sgd
from helpers.runs import Normal, batches, data_rows, reference_run

import gridtrain as gt

WINDOWS, WINDOW_BATCH = 3, 16
DATA = batches(WINDOWS, Normal((WINDOW_BATCH, MLP.D_IN)), Normal((WINDOW_BATCH, MLP.D_OUT)))
# fp32 sums of the same terms in another order (micro-batch means, then accumulation): ~1e-7
TOL = dict(rtol=1e-5, atol=1e-6)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _sgd_and_sched(model):
    opt = momentum_sgd(model)
    return opt, _sched(opt)


def _train_accumulated(ctx, micro):
    """The README's protocol: the same loop every micro-step, ``step()`` acting at the end
    of each window."""
    model = mlp()
    opt, sched = _sgd_and_sched(model)
    engine, _, _, sched = gt.initialize(model, opt, criterion=F.mse_loss, lr_scheduler=sched)
    micro_batches = []
    for x, y in (data_rows(batch, ctx) for batch in DATA):
        micro_batches += list(zip(x.chunk(micro), y.chunk(micro), strict=True))
    data = iter(micro_batches)
    stepped, lrs = [], []
    for _ in range(WINDOWS * micro):
        engine.zero_grad()
        engine.execute_schedule(data)
        stepped.append(engine.step())
        lrs.append(opt.param_groups[0]["lr"])
    return gt.full_state_dict(engine.model), stepped, lrs, sched.last_epoch


@pytest.mark.parametrize("world,micro", [(1, 4), (2, 2)])
def test_accumulation_equals_large_batch(world, micro):
    results = run_distributed(
        _train_accumulated, world, micro, config=dict(gradient_accumulation=micro), timeout=300
    )
    ref_state = reference_run(mlp, DATA, F.mse_loss, _sgd_and_sched).state
    for state, stepped, lrs, sched_steps in results:
        assert stepped == ([False] * (micro - 1) + [True]) * WINDOWS, "steps only at window end"
        assert sched_steps == WINDOWS, "the LR scheduler stepped once per window"
        assert lrs[micro - 1] == 0.05 and lrs[micro - 2] == 0.1  # exact: halved at the step
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], **TOL)


def _too_many_backwards(ctx):
    model = MLP()
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    x, y = DATA[0]
    for _ in range(3):  # gradient_accumulation = 2 and no step() in between
        engine.backward(engine.criterion(engine(x), y))


def test_backward_past_window_without_step_is_an_error():
    with pytest.raises(RuntimeError, match=r"backward called 3 times without engine.step\(\)"):
        run_distributed(_too_many_backwards, 1, config=dict(gradient_accumulation=2), timeout=300)
