"""The online ring attention's device path: torch's fused SDPA kernel per key block (CUDA's
memory-efficient kernel, which returns the log-sum-exp), the online-softmax merge of blocks,
and the fused autograd Function at sequence size 1 (NCCL group), against float64 attention
written out here and against ``F.scaled_dot_product_attention`` on the device.

References take the *same rounded inputs* upcast to float64, so the errors measured are the
kernel's own (rounding of P before P @ V and of the output), not the inputs' rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_env import max_abs, rel_err

from gridtrain.parallel.tensor.sequence.ring import (
    _block_fused,
    _keep_mask,
    _merge,
    allowed_mask,
    online_attention,
)

B, H, S, D = 2, 4, 256, 64
BLOCKS = 4  # key blocks of S / 4 for the merge test
SCALE = 1 / math.sqrt(D)
# dtype -> (output max |err|, log-sum-exp max |err|, gradient ||err|| / ||ref||). Outputs
# reach |o| ~ 3 (causal rows that see few keys), where one ulp is 1.6e-2 (bf16) / 2e-3 (fp16):
# the kernel rounds P before P @ V and the output once, so ~2 ulps there. The lse is
# accumulated in fp32 (|lse| ~ 6). Backward runs in fp32 and rounds each gradient once.
# Measured with GT_TEST_DEVICE=cpu: bf16 8e-3 / 6e-5 / 2e-3, fp16 1e-3 / 6e-5 / 2.5e-4,
# fp32 7e-7 / 7e-7 / 4e-7.
TOL = {
    torch.bfloat16: (4e-2, 1e-3, 1.5e-2),
    torch.float16: (5e-3, 1e-3, 2e-3),
    # fp32: summation order, and the CUDA kernel's fast exp2 in the lse (~1e-6 relative),
    # which backward's exp(s - lse) carries into every gradient
    torch.float32: (1e-4, 1e-4, 1e-4),
}
DTYPES = list(TOL)


def _inputs(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g).to(device, dtype) for _ in range(4))
    pad = torch.rand(B, S, generator=g) < 0.25
    pad[:, 0] = False  # every query row keeps a visible key (key 0 is never padded)
    return q, k, v, dout, pad.to(device)


def _dense64(q, k, v, dout, mask, keep=None, p=0.0):
    """softmax(q k^T * scale, masked) v in float64 with autograd: (out, dq, dk, dv, lse)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * SCALE
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)
    if keep is not None:
        probs = probs * keep / (1 - p)
    out = probs @ v
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, lse.detach()


def _mask(causal: bool, pad, rows=range(S), cols=range(S)):
    return allowed_mask(rows, cols, causal, pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_block_kernel_gives_output_and_lse(dtype, causal, device):
    """One block through the fused kernel (what each ring step runs): (out, lse) exact."""
    q, k, v, dout, pad = _inputs(device, dtype)
    mask = _mask(causal, pad)
    res = _block_fused(q, k, v, mask.to(device), SCALE)
    assert res is not None, f"no fused kernel with log-sum-exp for {dtype} on {device}"
    out, lse = res
    want_out, *_, want_lse = _dense64(q, k, v, dout, mask)
    out_tol, lse_tol, _ = TOL[dtype]
    assert max_abs(out, want_out) < out_tol, (dtype, max_abs(out, want_out))
    assert max_abs(lse, want_lse) < lse_tol, (dtype, max_abs(lse, want_lse))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_online_merge_of_key_blocks_equals_whole_softmax(dtype, device):
    """Key blocks one at a time through the fused kernel, merged by online softmax (the ring's
    forward without the ring), equal whole-sequence attention: causal + padding."""
    q, k, v, dout, pad = _inputs(device, dtype, seed=1)
    acc = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(B, H, S, D, dtype=acc, device=device)
    lse = torch.full((B, H, S, 1), float("-inf"), dtype=acc, device=device)
    s = S // BLOCKS
    for b in range(BLOCKS):
        cols = range(b * s, (b + 1) * s)
        mask = _mask(True, pad[:, b * s : (b + 1) * s], cols=cols).to(device)
        res = _block_fused(
            q, k[:, :, b * s : (b + 1) * s], v[:, :, b * s : (b + 1) * s], mask, SCALE
        )
        assert res is not None, f"no fused kernel with log-sum-exp for {dtype} on {device}"
        out, lse = _merge(out, lse, *res)
    want_out, *_, want_lse = _dense64(q, k, v, dout, _mask(True, pad))
    out_tol, lse_tol, _ = TOL[dtype]
    # each block's output is rounded once, then merged in fp32: no more than one block's error
    assert max_abs(out, want_out) < out_tol, (dtype, max_abs(out, want_out))
    assert max_abs(lse, want_lse) < lse_tol, (dtype, max_abs(lse, want_lse))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal+padding"])
def test_online_ring_attention_equals_dense(dtype, mask_kind, launch, device):
    """The fused autograd Function at sequence size 1 over the NCCL world group: output, dq,
    dk, dv against float64, and the output against SDPA on the device in the same dtype."""
    launch({})
    q, k, v, dout, pad = _inputs(device, dtype, seed=2)
    causal = "causal" in mask_kind
    kpm = pad if "padding" in mask_kind else None
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = online_attention(ql, kl, vl, dist.group.WORLD, causal, kpm, 0.0, SCALE)
    out.backward(dout)
    assert out.dtype == dtype and ql.grad.dtype == dtype
    mask = _mask(causal, kpm)
    want = _dense64(q, k, v, dout, None if mask is None else mask.to(device))
    out_tol, _, grad_tol = TOL[dtype]
    assert max_abs(out, want[0]) < out_tol, (dtype, mask_kind, max_abs(out, want[0]))
    for name, got, ref in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), want[1:4]):
        assert rel_err(got, ref) < grad_tol, (dtype, mask_kind, name, rel_err(got, ref))
    sdpa_mask = None if mask is None else mask.to(device)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=SCALE)
    # two kernels, each within out_tol of float64
    assert max_abs(out, sdpa) < 2 * out_tol, (dtype, mask_kind, max_abs(out, sdpa))


def test_online_dropout_regenerates_its_masks_on_device(launch, device):
    """With dropout the plain block path runs; its keep-masks come from a device generator
    and are regenerated in backward: equal to float64 attention with those masks."""
    launch({})
    p, seed = 0.2, 1234
    q, k, v, dout, _ = _inputs(device, torch.float32, seed=3)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = online_attention(ql, kl, vl, dist.group.WORLD, True, None, p, SCALE, seed)
    out.backward(dout)
    keep = _keep_mask(seed, 0, (B, H, S, S), device, p)  # rank 0 of 1 owns the one block
    assert 0.7 < keep.float().mean().item() < 0.9, "about 1 - p of the probabilities kept"
    want = _dense64(q, k, v, dout, _mask(True, None).to(device), keep.double(), p)
    # float32 matmuls against float64: rounding of sums over S = 256 keys (~1e-6 relative)
    assert max_abs(out, want[0]) < 1e-4, max_abs(out, want[0])
    for name, got, ref in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), want[1:4]):
        assert rel_err(got, ref) < 5e-5, (name, rel_err(got, ref))
