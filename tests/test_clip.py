"""Gradient clipping equals torch.nn.utils.clip_grad_norm_ on the dense model, in any layout."""

import pytest
import torch
import torch.nn.functional as F
from helpers.engine_models import (
    dense_state,
    dense_train,
    global_batches,
    rank_slice,
    sgd,
    sharded_model,
)
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.engine.clip import global_grad_norm
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import set_dp_mode, set_shard_spec

PM = gt.ParallelMode
STEPS, GLOBAL_BATCH, MAX_NORM = 3, 8, 0.05
# fp32: the squared norm is summed per shard then all-reduced (other order than torch): ~1e-7
TOL = dict(rtol=1e-5, atol=1e-6)


def _train_clipped(ctx):
    model = sharded_model(ctx, dense_state())
    engine, *_ = gt.initialize(model, sgd(model.parameters()), criterion=F.mse_loss)
    rank, world = ctx.local_rank(PM.DATA), ctx.world_size(PM.DATA)
    norms = []
    for x, y in global_batches(STEPS, GLOBAL_BATCH):
        engine.zero_grad()
        # the hand-sharded model needs no batch split (each tensor rank sees the whole batch)
        out = engine.forward_split(rank_slice(x, rank, world))
        engine.backward(engine.compute_loss(out, rank_slice(y, rank, world)))
        engine.step()
        norms.append(engine.last_grad_norm.item())
    return gt.full_state_dict(engine.model), norms


@pytest.mark.parametrize("world", [2, 4])
def test_clip_equals_torch_on_dense_model_under_tensor_parallelism(world):
    # tensor 2 (fc1 by column, fc2 by row, fc2.bias replicated) x data world/2
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")), clip_grad_norm=MAX_NORM)
    results = run_distributed(_train_clipped, world, config=config, timeout=300)
    ref_state, _, ref_norms = dense_train(
        dense_state(), global_batches(STEPS, GLOBAL_BATCH), sgd, clip=MAX_NORM
    )
    assert min(ref_norms) > MAX_NORM, "the test must actually clip"
    for state, norms in results:
        torch.testing.assert_close(torch.tensor(norms), torch.stack(ref_norms), **TOL)
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], **TOL)


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
    model = sharded_model(ctx, dense_state())
    engine, *_ = gt.initialize(model, sgd(model.parameters()), criterion=F.mse_loss)
    x, y = global_batches(1, 4)[0]
    engine.backward(engine.compute_loss(engine.forward_split(x), y))
    engine.step()
    return engine.last_grad_norm


def test_clipping_is_off_when_zero():
    assert run_distributed(_no_clip_by_default, 1, timeout=300) == [None]
