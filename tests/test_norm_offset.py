"""A plain model's norm that scales by ``1 + weight`` (as Gemma's RMSNorm does) keeps its
function under 2d: the planner probes each norm that is not torch's own, hands the grid norm
``offset=1``, and stores the weight as the model does; a norm of neither form is refused by
name before any weight moves."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from helpers.runs import (
    data_rows,
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    token_batches,
)
from torch import nn

import gridtrain as gt

STEPS, BATCH, SEQ, VOCAB, HIDDEN = 3, 8, 16, 64, 32
CONFIG_2D = dict(parallel=dict(tensor=dict(size=4, mode="2d")))


class OffsetRMSNorm(nn.Module):
    """``(1 + weight) * x / rms(x)``; the weight starts away from 0 so the offset matters."""

    def __init__(self, hidden: int, eps: float = 1e-6, scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(hidden))
        self.eps, self.scale = eps, scale

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale * normed * (1 + self.weight)


def _model(scale: float = 1.0):
    def build():
        model = TinyTransformer(vocab=VOCAB, hidden=HIDDEN, seq=SEQ)
        model.norm = OffsetRMSNorm(HIDDEN, scale=scale)
        return model

    return seeded(build, seed=0)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(ctx, batches):
    x0 = data_rows(batches[0][0], ctx)  # this rank's rows: traced for shapes only
    return engine_run(ctx, _model, batches, lm_loss, _adamw, example_inputs=x0)


def test_one_plus_weight_norm_under_2d_equals_one_process():
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = reference_run(_model, batches, dense_lm_loss, _adamw)
    results = run_distributed(_train, 4, batches, config=CONFIG_2D, timeout=300)
    # float64: the grid norm only reorders sums (<= 1e-15 relative measured); treating
    # (1 + w) as w changes the step-0 loss by O(1e-2)
    assert global_losses(results) == pytest.approx(ref.losses, rel=1e-12)
    for rank, run in enumerate(results):
        # the weight is stored as the model stores it (w, not 1 + w); AdamW's 1e-8 guard
        # bounds how far a 1e-16 gradient difference moves it
        torch.testing.assert_close(
            run.state["norm.weight"], ref.state["norm.weight"], rtol=1e-6, atol=1e-9
        )
        assert run.shares["norm.weight"] == pytest.approx(1 / 4), (rank, run.shares)


def _refused(ctx):
    try:
        gt.initialize(_model(scale=2.0), _adamw(_model()), lm_loss)
    except gt.PlanError as err:
        return str(err)
    return None


def test_a_norm_of_neither_form_is_refused_by_name():
    for message in run_distributed(_refused, 4, config=CONFIG_2D):
        assert message is not None, "a doubled norm was replaced silently"
        for word in ("'norm'", "OffsetRMSNorm", "(1 + weight)"):
            assert word in message, message
