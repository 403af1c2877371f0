"""ZeRO under torch amp (autocast fp16 + ShardedGradScaler) and bf16: the same training as the
same layout without ZeRO."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import token_batches
from test_zero import BATCH, SEQ, STEPS, VOCAB, _train

# (mode, stage): (loss rtol, weight atol)
CASES = {
    # autocast computes the same fp16 products from the same fp32 weights; two ranks' fp32
    # gradients sum alike whether all-reduced or reduce-scattered: float32 rounding only
    ("torch", 2): (1e-6, 1e-6),
    ("torch", 3): (1e-6, 1e-6),
    ("bf16", 2): (1e-6, 1e-6),
    # stage 3 gathers bf16 weights (FSDP2 MixedPrecisionPolicy) where autocast keeps fp32
    # for norms: bf16 rounding (2^-8) there. AdamW moves a weight by about lr = 1e-2 per step
    # whatever its gradient's size, so where the exact gradient is ~0 (a key bias, which
    # softmax ignores) rounding decides the sign: checked below on 99% of the elements
    ("bf16", 3): (1e-2, 5e-3),
}


@pytest.mark.parametrize("mode,stage", list(CASES))
def test_zero_under_amp_equals_the_same_layout_without(mode, stage):
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    fp16 = dict(mode=mode, initial_scale=2.0**10)
    plain = run_distributed(_train, 2, batches, torch.float32, config=dict(fp16=fp16), timeout=300)
    zero = run_distributed(
        _train, 2, batches, torch.float32, config=dict(fp16=fp16, zero=stage), timeout=300
    )
    rtol, atol = CASES[(mode, stage)]
    for rank in range(2):
        losses, final, _, skipped, scales = zero[rank]
        assert skipped == plain[rank][3] and scales == plain[rank][4]
        assert losses == pytest.approx(plain[rank][0], rel=rtol)
        if (mode, stage) == ("bf16", 3):
            diffs = torch.cat([(final[k] - v).abs().flatten() for k, v in plain[rank][1].items()])
            assert (diffs > atol).float().mean() < 0.01, (diffs > atol).float().mean()
            continue
        for k, v in plain[rank][1].items():
            torch.testing.assert_close(final[k], v, rtol=rtol, atol=atol, msg=k)
