"""fp32, bf16, torch fp16 (autocast + GradScaler) and naive fp16 (fp16 model, fp32 masters)
on one device through the engine, against the same GPT trained in float64 on the CPU.

Four momentum-SGD steps: every step must be taken (a modest initial loss scale), each
step's loss must match the reference's, and so must the total update of every parameter
(``||dw - dw_ref|| / ||dw_ref||``: SGD's update is the gradient history, so this is a check
of the low-precision gradients, unaffected by the weights' own rounding).
"""

from __future__ import annotations

import pytest
import torch
from gpu_env import ON_CUDA, STEPS, gpt, gpt_batches, rel_errs, sgd
from helpers.runs import engine_run, reference_run

from demos.gpt import model as gpt_model
from gridtrain.amp import AMP_TYPE

# mode -> (fp16 section, forward output dtype, loss tolerance, update tolerance). The
# tolerances are ~10x the errors measured with GT_TEST_DEVICE=cpu (given per mode as loss /
# update), leaving room for CUDA's kernels (other GEMM blocking, reduced-precision reductions).
MODES = {
    # float32 vs float64: rounding only (TF32 stays off); measured 6e-7 / 1.4e-4
    "fp32": (None, torch.float32, 1e-4, 1e-3),
    # bf16 autocast: 8 mantissa bits (~4e-3 per rounding) on every matmul; measured 5e-5 / 7.5e-3
    "bf16": (dict(mode=AMP_TYPE.BF16), torch.bfloat16, 5e-3, 6e-2),
    # fp16 autocast: 11 mantissa bits (~5e-4 per rounding); measured 2e-5 / 8e-4
    "torch fp16": (dict(mode=AMP_TYPE.TORCH, initial_scale=2.0**10), torch.float16, 1e-3, 1e-2),
    # the whole model in fp16 (norms and softmax too) with fp32 masters; measured 1e-5 / 2.5e-3
    "naive fp16": (dict(mode=AMP_TYPE.NAIVE, initial_scale=2.0**10), torch.float32, 1e-3, 2.5e-2),
}


@pytest.fixture(scope="module")
def ref():
    """The same GPT trained by plain PyTorch in float64 on the CPU."""
    data = gpt_batches()
    return data, reference_run(lambda: gpt(torch.float64), data, gpt_model.GPTLoss(), sgd)


def _taken_and_dtype(engine, outputs):
    return not engine.last_step_skipped, outputs[0].dtype


def _dtypes_and_devices(engine):
    """The model's parameters and the optimizer's (under naive fp16: its fp32 masters)."""
    model = {(p.dtype, p.device.type) for p in engine.model.parameters()}
    stepped = {(p.dtype, p.device.type) for g in engine.optimizer.param_groups for p in g["params"]}
    return model, stepped


@pytest.mark.parametrize("name", list(MODES))
def test_precision_mode_tracks_float64(name, ref, launch, device):
    fp16, out_dtype, loss_tol, upd_tol = MODES[name]
    data, want = ref
    ctx = launch(dict(fp16=fp16) if fp16 else {})
    run = engine_run(
        ctx, gpt, data, gpt_model.GPTLoss(), sgd, watch=_taken_and_dtype, probe=_dtypes_and_devices
    )
    print(f"\n{name}: losses {run.losses}\n  float64 {want.losses}")

    assert all(taken for taken, _ in run.watched), f"{name}: a step was skipped"
    expected_out = out_dtype
    if name == "torch fp16" and not ON_CUDA:  # fp16 autocast on a CPU without it runs bf16
        from gridtrain.amp.torch_amp import autocast_dtype

        expected_out = autocast_dtype(ctx.device, torch.float16)
    assert {d for _, d in run.watched} == {expected_out}, f"{name}: outputs {run.watched}"
    model, stepped = run.probed
    if name == "naive fp16":
        assert model == {(torch.float16, device.type)}, "naive keeps the model in fp16"
        assert stepped == {(torch.float32, device.type)}, "and fp32 masters, on the device"
    else:
        assert model == {(torch.float32, device.type)}, "fp32 and autocast keep fp32 weights"

    for step, (got, w) in enumerate(zip(run.losses, want.losses, strict=True)):
        assert abs(got - w) < loss_tol, (name, step, got, w)
    start = want.states[0]  # gt.full_state_dict: the fp32 masters under naive fp16
    assert run.state.keys() == start.keys()
    got_upd = {k: run.state[k].double() - start[k] for k in start}
    errs = rel_errs(got_upd, {k: want.state[k] - start[k] for k in start})
    worst = max(errs, key=errs.get)
    print(f"  worst update error {worst}: {errs[worst]:.2e}")
    for k, err in errs.items():
        assert err < upd_tol, (name, k, err)
    assert len(run.losses) == STEPS
