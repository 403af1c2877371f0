"""The speed defaults on one CUDA device: a config without ``compile``, ``attention`` and
``fused_optimizer`` compiles the model and the loss, puts cuDNN first on Hopper and steps
fused AdamW, trains as the same config with all three off (bf16 tolerance), shows the first
step's compile time, and a model torch.compile cannot build runs eagerly after one warning.
"""

from __future__ import annotations

import torch
from gpu_env import ON_CUDA, gpt_batches, is_hopper, rel_errs
from helpers.logs import gridtrain_warnings
from helpers.runs import engine_run
from helpers.tiny_lm import LM, lm_loss

import gridtrain as gt
from gridtrain.amp import AMP_TYPE
from gridtrain.engine import Trainer

BF16 = dict(fp16=dict(mode=AMP_TYPE.BF16))
OFF = dict(compile=False, attention=False, fused_optimizer=False)
VOCAB = 128  # gpt_batches' vocabulary


def _lm():
    torch.manual_seed(0)
    return LM(vocab=VOCAB, d=64)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _run(launch, config):
    ctx = launch(config)
    torch._dynamo.reset()
    speed = lambda engine: engine.speed  # noqa: E731
    run = engine_run(ctx, _lm, gpt_batches(), lm_loss, _adamw, probe=speed)
    gt.destroy()
    return run


def test_the_unset_config_is_the_fast_one_and_trains_as_all_off(launch):
    fast, off = _run(launch, BF16), _run(launch, {**BF16, **OFF})
    speed = fast.probed
    print(f"\ndefaults: compiled {speed.compiled}, optimizer {speed.optimizer}")
    if ON_CUDA:
        assert speed.compiled == ["", "criterion"], "one process: the model whole, and the loss"
        assert speed.optimizer == "fused"
        if is_hopper():
            assert speed.attention.backends[0] == "cudnn"
    else:  # GT_TEST_DEVICE=cpu: the CPU defaults
        assert speed.compiled == [] and speed.optimizer == "as built"
    assert off.probed.compiled == [] and off.probed.optimizer == "as built"
    # bf16: fused kernels keep some intermediates in fp32 that eager rounds (~4e-3 each);
    # AdamW's first steps move every weight by ~lr whatever the gradient's size
    for step, (a, b) in enumerate(zip(fast.losses, off.losses, strict=True)):
        assert abs(a - b) < 2e-2, (step, a, b)
    errs = rel_errs(fast.grads[0], off.grads[0], floor=1e-3)
    worst = max(errs, key=errs.get)
    assert errs[worst] < 5e-2, (worst, errs[worst])


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here (the test's backend)")


def test_a_model_that_fails_to_compile_runs_eagerly_after_one_warning(launch):
    torch._dynamo.register_backend(_failing_backend, name="gt_gpu_test_fails")
    ctx = launch(dict(compile=dict(backend="gt_gpu_test_fails", per_block=True, loss=False)))
    torch._dynamo.reset()
    with gridtrain_warnings() as warned:
        run = engine_run(ctx, _lm, gpt_batches(), lm_loss, _adamw)
    failed = [w for w in warned if "torch.compile failed" in w]
    assert len(failed) == 2, warned  # one per block, over every step
    assert "block 'blocks.0'" in failed[0] and "no compiler here" in failed[0]
    assert all(torch.isfinite(torch.tensor(run.losses)))


def test_the_first_steps_compile_time_is_reported(launch):
    launch(BF16)
    torch._dynamo.reset()
    model = _lm()
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss)
    trainer = Trainer(engine)
    trainer.fit(gpt_batches(2), epochs=1)  # the schedule moves each batch to the device
    if ON_CUDA:
        assert trainer.compile_s is not None and trainer.compile_s > 0
    else:
        assert trainer.compile_s is None, "the CPU default compiles nothing"
