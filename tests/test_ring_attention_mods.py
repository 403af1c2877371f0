"""``gt.nn.attention``'s sliding window, soft cap and sinks under sequence parallelism equal dense
attention over the whole sequence: output, dQ, dK, dV and the sinks' gradient, both ring
variants, on 2 and 4 gloo ranks (4: blocks the window hides wholly are skipped).

The reference is written out here with plain autograd (not the code under test): scores
``q k^T * scale``, capped ``c * tanh(x / c)``, keys outside the causal window or padded
masked, a per-head sink logit appended to each row before the softmax and its column
dropped after it (gpt-oss's eager attention).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.harness import run_distributed

import gridtrain as gt

B, H, S, D = 2, 3, 16, 4
CASES = {
    "window": dict(window=5),
    "softcap": dict(softcap=0.7),
    "sinks": dict(sinks=True),
    "window+softcap+sinks": dict(window=3, softcap=0.7, sinks=True),
}
# float64: the ring only reorders sums (measured <= 1e-15)
TOL = 1e-12


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4))
    pad = torch.rand(B, S, generator=g) < 0.3
    pad[:, ::4] = False  # every query keeps a visible key within any window of >= 3
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return q, k, v, dout, pad, sinks


def _dense(q, k, v, sinks, dout, pad, window=None, softcap=None):
    """Causal attention over the whole sequence with autograd; grads of q, k, v and sinks."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(S)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    allowed = allowed[None, None] & ~pad[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :S]
    out = probs @ v
    out.backward(dout)
    grads = (q.grad, k.grad, v.grad, None if sinks is None else sinks.grad)
    return out.detach(), grads


def _errors(ctx, case: str):
    """Max |ring - dense| of the output and each gradient on this rank (and the sinks' part
    of their gradient from this rank's rows)."""
    mode = gt.ParallelMode.SEQUENCE
    n, r = ctx.world_size(mode), ctx.local_rank(mode)
    mine = slice(r * S // n, (r + 1) * S // n)
    q, k, v, dout, pad, sinks = _inputs()
    mods = dict(CASES[case])
    use_sinks = mods.pop("sinks", False)
    want, want_grads = _dense(q, k, v, sinks if use_sinks else None, dout, pad, **mods)
    ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    sl = sinks.clone().requires_grad_() if use_sinks else None
    out = gt.nn.attention(ql, kl, vl, causal=True, key_padding_mask=pad[:, mine], sinks=sl, **mods)
    out.backward(dout[:, :, mine])
    errs = [(out.detach() - want[:, :, mine]).abs().max().item()]
    errs += [
        (g - w[:, :, mine]).abs().max().item()
        for g, w in zip((ql.grad, kl.grad, vl.grad), want_grads, strict=False)
    ]
    return errs, (sl.grad if use_sinks else None)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_window_softcap_and_sinks_equal_dense_attention(case, n):
    q, k, v, dout, pad, sinks = _inputs()
    mods = dict(CASES[case])
    use_sinks = mods.pop("sinks", False)
    _, want_grads = _dense(q, k, v, sinks if use_sinks else None, dout, pad, **mods)
    for variant in ("standard", "online"):
        tensor = dict(size=n, mode="sequence", ring_attention=variant)
        results = run_distributed(_errors, n, case, config=dict(parallel=dict(tensor=tensor)))
        worst = max(max(errs) for errs, _ in results)
        print(f"\n{case} n={n} {variant}: max |err| of (out, dq, dk, dv) {worst:.1e}")
        assert worst <= TOL, (case, n, variant, [errs for errs, _ in results])
        if use_sinks:  # each rank's rows give their part of the sinks' gradient
            total = sum(grad for _, grad in results)
            torch.testing.assert_close(total, want_grads[3], rtol=0, atol=TOL)
