"""ZeRO with mixture of experts: expert weights are sharded over EXPERT_DATA, the rest over DATA,
and training equals the same layout without ZeRO (which ``test_moe_parity`` equals to one
process)."""

import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import Ints, Normal, batches, engine_run, state_numel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from demos.moe.model import MoeCriterion, WideNet, WideNetConfig  # noqa: E402
from gridtrain.parallel.rows import get_zero_rows  # noqa: E402

CFG = WideNetConfig(  # as test_moe_parity: capacity 16 drops no token
    img_size=8,
    patch_size=4,
    depth=2,
    hidden=16,
    heads=2,
    ffn=16,
    num_experts=4,
    top_k=2,
    capacity_factor_train=16.0,
    capacity_factor_eval=16.0,
    use_z_loss=True,
    aux_loss_coef=0.1,
    z_loss_coef=0.01,
)
STEPS, GLOBAL_BATCH = 3, 8


def _batches():
    data = batches(STEPS, Normal((GLOBAL_BATCH, 3, 8, 8)), Ints(10, (GLOBAL_BATCH,)), seed=11)
    return [(x.double(), y) for x, y in data]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _held_and_row_groups(engine):
    """Optimizer-state elements this rank holds, and the groups ZeRO cut rows over."""
    modes = {
        info.mode.name
        for p in engine.optimizer.param_groups[0]["params"]
        if (info := get_zero_rows(p)) is not None
    }
    return state_numel(engine), sorted(modes)


def _train(ctx, batches):
    torch.manual_seed(5)
    model = WideNet(CFG).double()
    run = engine_run(
        ctx,
        lambda: model,
        batches,
        MoeCriterion(model),
        _adamw,
        probe=_held_and_row_groups,
        example_inputs=batches[0][0],
    )
    return (run.losses, run.state, *run.probed)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_experts_equals_the_same_layout_without(stage):
    config = dict(moe=dict(expert_parallel_size=2))
    plain = run_distributed(_train, 4, _batches(), config=config, timeout=300)
    zero = run_distributed(_train, 4, _batches(), config=dict(config, zero=stage), timeout=300)
    for rank in range(4):
        losses, final, held, modes = zero[rank]
        assert modes == ["DATA", "EXPERT_DATA"], modes  # each weight over its own group
        # float64, same math; only reduction orders differ (see test_zero.py)
        assert losses == pytest.approx(plain[rank][0], rel=1e-10)
        for k, v in plain[rank][1].items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=k)
        assert held < plain[rank][2] / 1.5, (held, plain[rank][2])
