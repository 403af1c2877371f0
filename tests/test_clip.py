"""Gradient clipping equals torch.nn.utils.clip_grad_norm_ on the dense model, in any layout."""

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import MLP, mlp, momentum_sgd
from helpers.runs import Normal, batches, engine_run, reference_run

import gridtrain as gt
from gridtrain.engine.clip import global_grad_norm
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import set_dp_mode, set_shard_spec

PM = gt.ParallelMode
STEPS, GLOBAL_BATCH, MAX_NORM = 3, 8, 0.05
DATA = batches(STEPS, Normal((GLOBAL_BATCH, MLP.D_IN)), Normal((GLOBAL_BATCH, MLP.D_OUT)))
# fp32: the squared norm is summed per shard then all-reduced (other order than torch): ~1e-7
TOL = dict(rtol=1e-5, atol=1e-6)


def _train_clipped(ctx):
    return engine_run(ctx, mlp, DATA, F.mse_loss, momentum_sgd)


@pytest.mark.parametrize("world", [2, 4])
def test_clip_equals_torch_on_dense_model_under_tensor_parallelism(world):
    # tensor 2 (fc1 by column, fc2 by row, fc2.bias replicated) x data world/2
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")), clip_grad_norm=MAX_NORM)
    runs = run_distributed(_train_clipped, world, config=config, timeout=300)
    ref = reference_run(mlp, DATA, F.mse_loss, momentum_sgd, clip=MAX_NORM)
    assert min(ref.norms) > MAX_NORM, "the test must actually clip"
    for run in runs:
        assert run.shares["fc1.weight"] == 0.5 and run.shares["fc2.bias"] == 1.0, run.shares
        torch.testing.assert_close(torch.tensor(run.norms), torch.tensor(ref.norms), **TOL)
        for key in ref.state:
            torch.testing.assert_close(run.state[key], ref.state[key], **TOL)


def _dense_grads(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _norm_pipeline_shared(ctx):
    shared, first, last = _dense_grads(0, (4, 3), (5,), (2, 2))
    tied = torch.nn.Parameter(torch.zeros(4, 3))
    tied._gt_pipeline_shared = True  # lives on both stages with equal (summed) gradients
    tied.grad = shared.clone()
    own = torch.nn.Parameter(torch.zeros_like(first if ctx.is_first_rank(PM.PIPELINE) else last))
    own.grad = (first if ctx.is_first_rank(PM.PIPELINE) else last).clone()
    expected = torch.cat([t.flatten() for t in (shared, first, last)]).norm()
    return global_grad_norm([tied, own], ctx).item(), expected.item()


def _norm_experts(ctx):
    # world 4 = data 4, expert_parallel_size 2: expert e lives on EXPERT rank e, twice over
    experts, dense = _dense_grads(1, (2, 3, 3), (6,))
    w = torch.nn.Parameter(torch.zeros(1, 3, 3))
    set_dp_mode(set_shard_spec(w, (0, PM.EXPERT)), PM.EXPERT_DATA)
    w.grad = shard_tensor(experts, ((0, PM.EXPERT),), ctx)
    b = torch.nn.Parameter(torch.zeros(6))
    b.grad = dense.clone()
    expected = torch.cat([experts.flatten(), dense]).norm()
    return global_grad_norm([w, b], ctx).item(), expected.item()


def _norm_2p5d(ctx):
    # tensor 8 = depth 2 x 2 x 2: a weight split over ROW and COL is replicated over DEP
    weight, bias = _dense_grads(2, (4, 6), (6,))
    spec = ((0, PM.PARALLEL_2P5D_ROW), (1, PM.PARALLEL_2P5D_COL))
    w = set_shard_spec(torch.nn.Parameter(torch.zeros(2, 3)), *spec)
    w.grad = shard_tensor(weight, spec, ctx)
    b = set_shard_spec(torch.nn.Parameter(torch.zeros(3)), (0, PM.PARALLEL_2P5D_COL))
    b.grad = shard_tensor(bias, ((0, PM.PARALLEL_2P5D_COL),), ctx)
    expected = torch.cat([weight.flatten(), bias]).norm()
    return global_grad_norm([w, b, w], ctx).item(), expected.item()  # duplicates count once


@pytest.mark.parametrize(
    "fn,world,config",
    [
        (_norm_pipeline_shared, 2, dict(parallel=dict(pipeline=2))),
        (_norm_experts, 4, dict(moe=dict(expert_parallel_size=2))),
        (_norm_2p5d, 8, dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2)))),
    ],
    ids=["pipeline-shared", "experts", "2.5d-depth-2"],
)
def test_global_norm_counts_every_shard_once(fn, world, config):
    for norm, expected in run_distributed(fn, world, config=config, timeout=300):
        assert abs(norm - expected) <= 1e-5 * expected, (norm, expected)  # fp32 sum order


def _no_clip_by_default(ctx):
    return engine_run(ctx, mlp, DATA[:1], F.mse_loss, momentum_sgd).norms


def test_clipping_is_off_when_zero():
    assert run_distributed(_no_clip_by_default, 1, timeout=300) == [[None]]
