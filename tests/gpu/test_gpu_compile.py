"""``compile`` on one device: each repeated block compiled by inductor (Triton kernels on
CUDA) trains as the eager engine does over 3 steps, in fp32 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
from gpu_env import CFG, SEQ, assert_runs_close, gpt_batches, rel_errs, sgd
from helpers.models import TinyTransformer
from helpers.runs import engine_run

import gridtrain as gt
from demos.gpt import model as gpt_model
from gridtrain.amp import AMP_TYPE

pytest.importorskip("gridtrain.engine.compile", reason="the compile config key is not here yet")

STEPS = 3


def _model():
    """The tests' transformer with a fused qkv (as GPT-2): the key bias, whose gradient is 0
    and so pure rounding noise, then shares a tensor with the query and value biases."""
    torch.manual_seed(0)  # the same fp32 weights for the eager and the compiled engine
    return TinyTransformer(vocab=CFG.vocab_size, hidden=64, layers=2, seq=SEQ, fused=True)


def _run(launch, compiled: bool, fp16):
    config = dict(fp16=fp16) if fp16 else {}
    if compiled:
        config["compile"] = dict(backend="inductor")
    ctx = launch(config)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = engine_run(ctx, _model, gpt_batches(STEPS), gpt_model.GPTLoss(), sgd)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    gt.destroy()  # the next run launches its own context
    return run.losses, run.grads[0], {k: v.float() for k, v in run.state.items()}, graphs


# mode -> (fp16 section, loss tolerance, gradient and update tolerance ||err|| / ||ref||).
# Measured with GT_TEST_DEVICE=cpu (C++ kernels): fp32 0 / 5e-7, bf16 7e-5 / 1.4e-3; the
# margins leave room for Triton's own fusions and reduction orders on CUDA.
MODES = {
    # fp32: inductor fuses elementwise ops and reorders reductions, ~1e-6 relative per op
    "fp32": (None, 1e-4, 5e-4),
    # bf16: fused kernels keep some intermediates in fp32 that eager rounds to bf16 between
    # ops (~4e-3 per rounding, on a few tensors)
    "bf16": (dict(mode=AMP_TYPE.BF16), 2e-3, 2e-2),
}


@pytest.mark.parametrize("name", list(MODES))
def test_compiled_engine_trains_as_eager(name, launch):
    fp16, loss_tol, tol = MODES[name]
    start = {n: t.float() for n, t in _model().state_dict().items()}
    e_losses, e_grads, e_final, _ = _run(launch, False, fp16)
    c_losses, c_grads, c_final, graphs = _run(launch, True, fp16)
    assert graphs >= 1, "nothing was compiled"
    print(f"\n{name}: compiled {c_losses}\n  eager {e_losses}")
    assert_runs_close(name, c_losses, e_losses, loss_tol, c_grads, e_grads, tol)
    assert c_final.keys() == e_final.keys()
    c_upd = {k: w - start[k] for k, w in c_final.items()}  # SGD: the gradient history
    e_upd = {k: w - start[k] for k, w in e_final.items()}
    for k, err in rel_errs(c_upd, e_upd).items():
        assert err < tol, (name, "update", k, err)
