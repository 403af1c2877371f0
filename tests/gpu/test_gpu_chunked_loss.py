"""``chunked_loss`` on one device: the head and its cross entropy in token chunks give the
unfused path's losses and gradients, in fp32 and under bf16 autocast (the case that
matters on a GPU), both engines on the same device from the same weights and batches."""

from __future__ import annotations

import pytest
from gpu_env import BATCH, SEQ, assert_runs_close, gpt, gpt_batches, sgd
from helpers.runs import engine_run

import gridtrain as gt
from demos.gpt import model as gpt_model
from gridtrain.amp import AMP_TYPE
from gridtrain.parallel.tensor.chunked_loss import DeferredLogits

CHUNK_TOKENS = BATCH * SEQ // 4  # 4 chunks per batch


def _deferred(engine, outputs):
    return isinstance(outputs[0], DeferredLogits)


def _run(launch, chunked: bool, fp16):
    """Losses of every step, first-step gradients by name, and whether logits were deferred."""
    config = dict(fp16=fp16) if fp16 else {}
    if chunked:
        config["chunked_loss"] = dict(chunk_tokens=CHUNK_TOKENS)
    ctx = launch(config)
    data = gpt_batches()
    example = data[0][0]  # chunked_loss traces the head with it
    run = engine_run(
        ctx, gpt, data, gpt_model.GPTLoss(), sgd, watch=_deferred, example_inputs=example
    )
    gt.destroy()  # the next run launches its own context
    return run.losses, run.grads[0], run.watched


# mode -> (fp16 section, loss tolerance, gradient tolerance ||g - g_ref|| / ||g_ref||)
MODES = {
    # fp32: the same per-token products; only the order of the loss and head-gradient sums
    # over tokens changes (4 chunks), ~1e-7 relative
    "fp32": (None, 1e-5, 1e-4),
    # bf16: the unfused head-weight gradient is one bf16 GEMM output (one rounding of the
    # whole sum), the chunked one 4 bf16 partial sums added in fp32: ~2^-8 relative apart
    "bf16": (dict(mode=AMP_TYPE.BF16), 1e-3, 2e-2),
}


@pytest.mark.parametrize("name", list(MODES))
def test_chunked_loss_equals_unfused_loss(name, launch):
    fp16, loss_tol, grad_tol = MODES[name]
    ref_losses, ref_grads, ref_deferred = _run(launch, False, fp16)
    losses, grads, deferred = _run(launch, True, fp16)
    assert not any(ref_deferred) and all(deferred), "only chunked_loss defers the logits"
    print(f"\n{name}: chunked {losses}\n  unfused {ref_losses}")
    assert_runs_close(name, losses, ref_losses, loss_tol, grads, ref_grads, grad_tol)
