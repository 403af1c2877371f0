"""Mixed precision: naive fp16 and torch amp survive overflow on one rank; bf16/fp16 track fp32."""

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import MLP, mlp, momentum_sgd
from helpers.runs import Normal, batches, engine_step, reference_run

import gridtrain as gt
from gridtrain.amp import AMP_TYPE

PM = gt.ParallelMode
STEPS, BATCH, OVERFLOW_STEP = 5, 8, 1
TP2 = dict(tensor=dict(size=2, mode="1d"))
DATA = batches(STEPS + 1, Normal((BATCH, MLP.D_IN)), Normal((BATCH, MLP.D_OUT)))


def _scale(engine):
    scaler = engine.optimizer.scaler
    return scaler.scale if hasattr(scaler, "min_scale") else scaler.get_scale()


def _train_with_overflow(ctx):
    model = mlp()  # under 1d: fc1 by column, so each tensor rank holds half of its weight
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    stepped, scales, unchanged, finite = [], [], None, True
    for i, (x, y) in enumerate(DATA):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        if i == OVERFLOW_STEP:
            before = gt.full_state_dict(engine.model)
            if ctx.local_rank(PM.TENSOR) == 1:  # only this rank's shard of fc1 overflows
                model.fc1.weight.grad[0, 0] = float("inf")
        stepped.append(engine.step())
        scales.append(_scale(engine))
        if i == OVERFLOW_STEP:
            after = gt.full_state_dict(engine.model)
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
        finite &= all(torch.isfinite(p).all().item() for p in engine.model.parameters())
    state = gt.full_state_dict(engine.model, ctx)
    return stepped, scales, unchanged, finite, state


@pytest.mark.parametrize("mode", [AMP_TYPE.NAIVE, AMP_TYPE.TORCH])
def test_overflow_on_one_rank_skips_the_step_on_all(mode):
    fp16 = dict(mode=mode, initial_scale=2.0**8, growth_interval=100, hysteresis=1)
    config = dict(parallel=TP2, fp16=fp16)
    results = run_distributed(_train_with_overflow, 2, config=config, timeout=300)
    expected_steps = [i != OVERFLOW_STEP for i in range(STEPS + 1)]
    for stepped, scales, unchanged, finite, _ in results:
        assert stepped == expected_steps, "both ranks skipped the overflow step, and only it"
        assert scales[OVERFLOW_STEP - 1] == 2.0**8 and scales[OVERFLOW_STEP] == 2.0**7, scales
        assert unchanged, "the skipped step changed no weight"
        assert finite, "no NaN/inf ever reached the weights"
    # then it trains like fp32 on the batches whose steps were taken
    kept = [b for i, b in enumerate(DATA) if i != OVERFLOW_STEP]
    ref = reference_run(mlp, kept, F.mse_loss, momentum_sgd).state
    for key in ref:
        # fp16 activations/gradients (11-bit mantissa, ~5e-4 relative per op) over 5 SGD steps
        # on O(0.3) weights: measured 1.4e-4 (naive) / 6e-5 (torch); 1e-3 is ~1/50 of one step
        err = (results[0][4][key].float() - ref[key]).abs().max().item()
        assert err < 1e-3, (key, err)


def _train_autocast(ctx):
    model = mlp()
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    outputs = []
    for batch in DATA[:STEPS]:  # the whole batch on each rank: the replicas must stay equal
        engine_step(engine, *batch, ctx, outputs=outputs)
        assert not engine.last_step_skipped
    out_dtypes = [out.dtype for out in outputs]
    return out_dtypes, gt.full_state_dict(engine.model), model.fc1.weight.dtype


@pytest.mark.parametrize(
    "mode,dtype,tol",
    # bf16 keeps 8 mantissa bits (~4e-3 relative per op), fp16 11 bits; after 5 momentum-SGD
    # steps on O(0.3) weights we measured 1.4e-3 (bf16) and 8e-5 (fp16); one step moves ~0.05
    [(AMP_TYPE.BF16, torch.bfloat16, 1e-2), (AMP_TYPE.TORCH, torch.float16, 1e-3)],
)
def test_autocast_modes_run_in_low_precision_and_stay_close_to_fp32(mode, dtype, tol):
    results = run_distributed(_train_autocast, 2, config=dict(fp16=dict(mode=mode)), timeout=300)
    ref = reference_run(mlp, DATA[:STEPS], F.mse_loss, momentum_sgd).state
    for out_dtypes, state, weight_dtype in results:
        assert set(out_dtypes) == {dtype}, "the forward ran under autocast"
        assert weight_dtype == torch.float32, "autocast keeps fp32 weights"
        for key in ref:
            err = (state[key] - ref[key]).abs().max().item()
            assert err < tol, (mode, key, err)
    # data-parallel replicas stay identical
    for key in ref:
        assert torch.equal(results[0][1][key], results[1][1][key])


def _naive_dtypes(ctx):
    model = MLP()
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    masters = [m.dtype for g in engine.optimizer.param_groups for m in g["params"]]
    return model.fc1.weight.dtype, set(masters), engine(torch.randn(2, 8)).dtype


def test_naive_keeps_fp16_model_and_fp32_masters():
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE))
    ((model_dtype, master_dtypes, out_dtype),) = run_distributed(
        _naive_dtypes, 1, config=config, timeout=300
    )
    assert model_dtype == torch.float16 and master_dtypes == {torch.float32}
    assert out_dtype == torch.float32, "outputs come back in fp32 for the loss"


def _apex(ctx):
    model = MLP()
    gt.initialize(model, momentum_sgd(model))


def test_apex_missing_names_the_alternatives():
    try:
        import apex  # noqa: F401

        pytest.skip("apex is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="needs NVIDIA apex.*AMP_TYPE.TORCH"):
        run_distributed(_apex, 1, config=dict(fp16=dict(mode=AMP_TYPE.APEX)), timeout=300)
