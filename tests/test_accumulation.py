"""Gradient accumulation: N micro-steps equal one optimizer step on the N-times-larger batch."""

import pytest
import torch
import torch.nn.functional as F
from helpers.engine_models import MLP, dense_state, dense_train, global_batches, rank_slice, sgd
from helpers.harness import run_distributed

import gridtrain as gt

PM = gt.ParallelMode
WINDOWS, WINDOW_BATCH = 3, 16
# fp32 sums of the same terms in another order (micro-batch means, then accumulation): ~1e-7
TOL = dict(rtol=1e-5, atol=1e-6)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _train_accumulated(ctx, micro):
    model = MLP()
    model.load_state_dict(dense_state())
    opt = sgd(model.parameters())
    engine, _, _, sched = gt.initialize(model, opt, criterion=F.mse_loss, lr_scheduler=_sched(opt))
    rank, world = ctx.local_rank(PM.DATA), ctx.world_size(PM.DATA)
    micro_batches = []
    for x, y in global_batches(WINDOWS, WINDOW_BATCH):
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
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
    ref_state, _, _ = dense_train(
        dense_state(), global_batches(WINDOWS, WINDOW_BATCH), sgd, make_sched=_sched
    )
    for state, stepped, lrs, sched_steps in results:
        assert stepped == ([False] * (micro - 1) + [True]) * WINDOWS, "steps only at window end"
        assert sched_steps == WINDOWS, "the LR scheduler stepped once per window"
        assert lrs[micro - 1] == 0.05 and lrs[micro - 2] == 0.1  # exact: halved at the step
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], **TOL)


def _too_many_backwards(ctx):
    model = MLP()
    engine, *_ = gt.initialize(model, sgd(model.parameters()), criterion=F.mse_loss)
    x, y = global_batches(1, 4)[0]
    for _ in range(3):  # gradient_accumulation = 2 and no step() in between
        engine.backward(engine.criterion(engine(x), y))


def test_backward_past_window_without_step_is_an_error():
    with pytest.raises(RuntimeError, match=r"backward called 3 times without engine.step\(\)"):
        run_distributed(_too_many_backwards, 1, config=dict(gradient_accumulation=2), timeout=300)
