"""ZeRO with mixture of experts: expert weights are sharded over EXPERT_DATA, the rest over DATA,
and training equals the same layout without ZeRO (which ``test_moe_parity`` equals to one
process)."""

import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import gridtrain as gt  # noqa: E402
from demos.moe.model import MoeCriterion, WideNet, WideNetConfig  # noqa: E402
from gridtrain.parallel.zero.memory import optimizer_state_numel  # noqa: E402
from gridtrain.parallel.zero.rows import get_zero_rows  # noqa: E402

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
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g),
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train(ctx, batches):
    torch.manual_seed(5)
    model = WideNet(CFG).double()
    crit = MoeCriterion(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = gt.initialize(model, opt, criterion=crit, example_inputs=batches[0][0].double())
    d, dr = ctx.world_size(gt.ParallelMode.DATA), ctx.local_rank(gt.ParallelMode.DATA)
    losses = []
    for x, y in batches:
        engine.zero_grad()
        loss = engine.criterion(engine(x.double().chunk(d)[dr]), y.chunk(d)[dr])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    modes = sorted(
        {
            info.mode.name
            for p in engine.optimizer.param_groups[0]["params"]
            if (info := get_zero_rows(p)) is not None
        }
    )
    return (
        losses,
        gt.full_state_dict(engine.model),
        optimizer_state_numel(engine.optimizer),
        modes,
    )


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
