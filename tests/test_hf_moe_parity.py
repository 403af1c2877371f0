"""Hugging Face mixture-of-experts models spread over the EXPERT group by config alone equal the
same model trained in one process holding every expert.

For Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and DeepSeek-V3 (shared experts, grouped
routing): ``moe = dict(expert_parallel_size=2)`` on 2 ranks, the user's loop unchanged
(cross entropy of ``out.logits`` plus the model's router loss, ``output_router_logits``).
Each rank must hold half of every expert tensor (a run where every rank holds every expert
fails), and losses, every step's gradients and the weights after 3 AdamW steps must equal
the one-process run's.
"""

from __future__ import annotations

import pytest
from helpers.harness import run_distributed
from helpers.hf_moe import (
    FAMILIES,
    STEPS,
    adamw,
    dense_moe_loss,
    expert_keys,
    moe_batches,
    moe_loss,
    tiny_moe,
)
from helpers.runs import assert_grads_close, engine_run, global_losses, reference_run

COEF = 0.1  # router loss weight: large enough that a wrong router-loss gradient shows
# float32 on both sides; the layouts differ by summation order (all-to-all partial sums, the
# grouped matmul over other row blocks, the gathered router loss): measured <= 2e-6 relative
TOL = dict(rtol=1e-5, atol=1e-6)


def train_engine(ctx, family, batches, **model_kw):
    model = tiny_moe(family, **model_kw)
    keys = expert_keys(model)
    run = engine_run(
        ctx,
        lambda: model,
        batches,
        moe_loss(COEF),
        adamw,
        grad_steps=STEPS,
        example_inputs=batches[0][0],
    )
    return run, {k: run.shares[k] for k in keys}


def check_parity(family, world, config, ep, batches=None, **model_kw):
    """Train ``family`` under ``config`` on ``world`` ranks and in one process; assert equal
    losses, gradients and weights, and that each rank holds 1/ep of every expert tensor."""
    batches = batches or moe_batches()
    build = lambda: tiny_moe(family, **model_kw)  # noqa: E731
    ref = reference_run(build, batches, dense_moe_loss(COEF), adamw, grad_steps=STEPS)
    results = run_distributed(
        train_engine, world, family, batches, config=config, timeout=300, **model_kw
    )
    runs = [run for run, _ in results]
    for rank, (run, held) in enumerate(results):
        assert held and all(share == 1 / ep for share in held.values()), (rank, held)
        for step in range(STEPS):
            assert_grads_close(run.grads[step], ref, step, f"{family} {rank} {step}", **TOL)
        for key, value in run.state.items():
            assert value.shape == ref.state[key].shape, key  # the HF model's own dense keys
            assert_close(value, ref.state[key], f"{family} rank {rank} {key}")
    assert global_losses(runs) == pytest.approx(ref.losses, rel=1e-5)
    return runs


def assert_close(got, want, msg):
    import torch

    torch.testing.assert_close(got, want, msg=msg, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_spread_over_two_ranks_equal_one_process(family):
    check_parity(family, 2, dict(moe=dict(expert_parallel_size=2)), ep=2)
