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
from gpt_runs import STEPS, batches, initial_params, make_engine, params, reference, train
from gpu_env import ON_CUDA, rel_errs

from gridtrain.amp import AMP_TYPE
from gridtrain.parallel.sharding import unwrap

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
    data = batches()
    return data, *reference(data)


@pytest.mark.parametrize("name", list(MODES))
def test_precision_mode_tracks_float64(name, ref, launch, device):
    fp16, out_dtype, loss_tol, upd_tol = MODES[name]
    data, ref_losses, ref_params = ref
    ctx = launch(dict(fp16=fp16) if fp16 else {})
    engine = make_engine()
    record = train(engine, data, device)
    losses = [r[0] for r in record]
    print(f"\n{name}: losses {losses}\n  float64 {ref_losses}")

    assert all(r[1] for r in record), f"{name}: a step was skipped (overflow or non-finite)"
    expected_out = out_dtype
    if name == "torch fp16" and not ON_CUDA:  # fp16 autocast on a CPU without it runs bf16
        from gridtrain.amp.torch_amp import autocast_dtype

        expected_out = autocast_dtype(ctx.device, torch.float16)
    assert {r[2] for r in record} == {expected_out}, f"{name}: forward output dtypes {record}"
    model_dtypes = {p.dtype for p in unwrap(engine.model).parameters()}
    model_devices = {p.device.type for p in unwrap(engine.model).parameters()}
    assert model_devices == {device.type}, model_devices
    if name == "naive fp16":
        masters = engine.optimizer.masters()
        assert model_dtypes == {torch.float16}, "naive keeps the model in fp16"
        assert {m.dtype for _, m in masters} == {torch.float32}, "and fp32 master weights"
        assert {m.device.type for _, m in masters} == {device.type}, "masters on the device"
    else:
        assert model_dtypes == {torch.float32}, "fp32 and autocast modes keep fp32 weights"

    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) < loss_tol, (name, step, got, want)
    start, got_params = initial_params(), params(engine)
    assert got_params.keys() == ref_params.keys()
    got_upd = {k: got_params[k].double() - start[k] for k in start}
    errs = rel_errs(got_upd, {k: ref_params[k] - start[k] for k in start})
    worst = max(errs, key=errs.get)
    print(f"  worst update error {worst}: {errs[worst]:.2e}")
    for k, err in errs.items():
        assert err < upd_tol, (name, k, err)
    assert len(losses) == STEPS
