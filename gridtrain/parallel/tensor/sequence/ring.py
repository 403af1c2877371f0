"""Ring self-attention over the sequence group (Li et al. 2021, "Sequence Parallelism").

Each rank of the SEQUENCE group holds a contiguous block of ``s = S / N``
positions of the queries, keys and values (rank ``r`` holds ``[r*s, (r+1)*s)``),
laid out ``[B, H, s, D]`` as for ``scaled_dot_product_attention``. Key and value
blocks travel round the ring (``comm.ring_pass``) so that every query block
meets every key block once.

Two variants, equal in result (``parallel.tensor.ring_attention`` picks one):

* ``"standard"``, the paper's: ``RingQK`` builds this rank's ``s x S`` score
  rows, a plain softmax normalises them, ``RingAV`` multiplies by the values.
* ``"online"``, memory-lean: one fused autograd Function keeps a running
  max/sum per query row (online softmax, as in FlashAttention / ring attention
  of Liu et al. 2023), so only one ``s x s`` block of scores exists at a time,
  forward and backward. Blocks run through torch's fused SDPA kernel where it
  can return the log-sum-exp (no dropout), else through plain matmuls.

Both backward passes send each key/value gradient accumulator round the ring
with its block, so dQ, dK and dV are exact.

Both also compute what attention variants do to the scores, from global positions, as
one process would: a sliding ``window`` (a query sees only the ``window`` keys ending at
itself, Mistral's and Gemma's local layers), a ``softcap`` (scores ``c * tanh(x / c)``
after scaling, Gemma2's) and ``sinks`` (a learned logit per head in every row's softmax
denominator that attends to nothing, gpt-oss's). The online variant skips key blocks the
window or causality hides entirely.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gridtrain.parallel import comm

NEG_INF = float("-inf")


def _ring(x: Tensor, group) -> Tensor:
    with torch.no_grad():
        return comm.ring_pass(x, group)


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: at least float32 (fp16/bf16 inputs), float64 stays float64."""
    return torch.promote_types(t.dtype, torch.float32)


def _span(owner: int, s: int) -> slice:
    return slice(owner * s, (owner + 1) * s)


def _ring_blocks(x: Tensor, group):
    """Each block of ``x``'s ring as it passes this rank, its own first: (the owner's span of
    the ``S`` positions, the block); every rank holds the next block after each step."""
    n, r, s = comm.world(group), comm.rank_in(group), x.shape[-2]
    for i in range(n):
        yield _span((r - i) % n, s), x
        if i < n - 1:
            x = _ring(x, group)


# ---- standard variant: the paper's RingQK and RingAV ----------------------------------------
class RingQK(torch.autograd.Function):
    """``scores[..., owner's block] = q @ k_owner^T``: ``[B,H,s,D] x ring -> [B,H,s,S]``.

    Backward: dQ accumulates locally while the key blocks travel the ring again;
    each dK partial rides the ring with its block and arrives at its owner.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, group) -> Tensor:
        out = q.new_empty(q.shape[:-1] + (comm.world(group) * k.shape[-2],))
        for span, kb in _ring_blocks(k, group):
            out[..., span] = q @ kb.transpose(-1, -2)
        ctx.save_for_backward(q, k)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k = ctx.saved_tensors
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)  # the accumulator of the block currently held
        for span, kb in _ring_blocks(k, ctx.group):
            dq += grad[..., span] @ kb
            dk += grad[..., span].transpose(-1, -2) @ q
            dk = _ring(dk, ctx.group)  # n passes in all: back at the block's owner
        return dq, dk, None


class RingAV(torch.autograd.Function):
    """``out = sum over owners of p[..., owner's block] @ v_owner``: ``[B,H,s,S] x ring -> [B,H,s,D]``."""

    @staticmethod
    def forward(ctx, p: Tensor, v: Tensor, group) -> Tensor:
        out = p.new_zeros(p.shape[:-1] + (v.shape[-1],))
        for span, vb in _ring_blocks(v, group):
            out += p[..., span] @ vb
        ctx.save_for_backward(p, v)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        p, v = ctx.saved_tensors
        dp = torch.empty_like(p)
        dv = torch.zeros_like(v)  # the accumulator of the block currently held
        for span, vb in _ring_blocks(v, ctx.group):
            dp[..., span] = grad @ vb.transpose(-1, -2)
            dv += p[..., span].transpose(-1, -2) @ grad
            dv = _ring(dv, ctx.group)  # n passes in all: back at the block's owner
        return dp, dv, None


def allowed_mask(
    rows: range, cols: range, causal: bool, key_pad: Tensor | None, window: int | None = None
) -> Tensor | None:
    """Bool ``[B|1, 1, len(rows), len(cols)]``, True where query row may see key col; None = all.

    ``rows``/``cols`` are global positions; ``key_pad`` is ``[B, len(cols)]``, True = padding;
    ``window``: a query sees only keys fewer than ``window`` positions behind it
    (``transformers``' sliding window: ``kv > q - window``).
    """
    mask = None
    if causal or window is not None:
        r = torch.tensor(rows).unsqueeze(1)
        c = torch.tensor(cols).unsqueeze(0)
        mask = torch.ones(len(rows), len(cols), dtype=torch.bool)
        if causal:
            mask &= c <= r
        if window is not None:
            mask &= c > r - window
        mask = mask[None, None]
    if key_pad is not None:
        keep = ~key_pad[:, None, None, :]
        mask = keep if mask is None else keep & mask.to(keep.device)
    return mask


def capped(scores: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma2's attention soft cap), or ``scores``."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax_probs(scores: Tensor, mask: Tensor | None, sinks: Tensor | None, dtype) -> Tensor:
    """The softmax over the keys of ``scores`` (``[B, H, s, keys]``), masked keys excluded and
    computed in at least float32; ``sinks`` (``[H]``): one more logit per head in each row's
    denominator, whose probability is dropped (it attends to nothing)."""
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), NEG_INF)
    scores = scores.to(_acc(scores))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(dtype)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(dtype)


def standard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    causal: bool,
    key_pad_full: Tensor | None,
    dropout_p: float,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The paper's ring self-attention: keeps this rank's ``s x S`` scores and probabilities."""
    n, r, s = comm.world(group), comm.rank_in(group), q.shape[-2]
    scores = capped(RingQK.apply(q, k, group) * scale, softcap)
    mask = allowed_mask(range(r * s, (r + 1) * s), range(n * s), causal, key_pad_full, window)
    probs = softmax_probs(scores, mask, sinks, q.dtype)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return RingAV.apply(probs, v, group)


# ---- online variant: one s x s block at a time ----------------------------------------------
def _keep_mask(seed: int, owner: int, shape, device, p: float) -> Tensor:
    """The dropout keep-mask of one key block, regenerated identically in backward."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + owner)
    return torch.rand(shape, generator=gen, device=device) >= p


def _block_fused(q: Tensor, kb: Tensor, vb: Tensor, mask: Tensor | None, scale: float):
    """(out, lse) of one block from torch's fused kernel, or None where it cannot give lse."""
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, NEG_INF)
    try:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, kb, vb, 0.0, False, attn_mask=bias, scale=scale
            )
        elif q.device.type == "cuda":
            if bias is not None:
                bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], kb.shape[2])
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, kb, vb, bias, True, 0.0, False, scale=scale
            )
        else:
            return None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    if lse.dim() != 3 or lse.shape[-1] < q.shape[-2]:
        return None
    lse = lse[..., : q.shape[-2]].unsqueeze(-1).to(_acc(q))
    out = out.to(_acc(q))
    if mask is not None:  # the kernels report lse 0 (not -inf) for a row with every key masked
        dead = ~mask.any(dim=-1, keepdim=True)
        lse = lse.masked_fill(dead, NEG_INF)
        out = out.masked_fill(dead, 0.0)
    return out, lse


def _block_plain(q, kb, vb, mask, scale, keep, dropout_p, softcap=None):
    """(out, lse) of one block with matmuls; dropout scales the kept probabilities."""
    sc = capped((q @ kb.transpose(-1, -2)).to(_acc(q)) * scale, softcap)
    if mask is not None:
        sc = sc.masked_fill(~mask, NEG_INF)
    m = sc.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(sc - m)
    denom = p.sum(dim=-1, keepdim=True)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = (p.to(vb.dtype) @ vb).to(sc.dtype) / denom.clamp_min(torch.finfo(sc.dtype).tiny)
    return out, m + torch.log(denom)


class RingOnlineAttention(torch.autograd.Function):
    """Ring attention with online softmax: saves only q, k, v, out and the row log-sum-exp.

    ``mods``: (window, softcap); ``sinks`` (``[H]`` or None) are merged into the log-sum-exp
    after the ring, and get their gradient ``-sum(p_sink * rowsum(dO * O))``."""

    @staticmethod
    def forward(ctx, q, k, v, key_pad_full, sinks, group, causal, scale, dropout_p, seed, mods):
        n, r, s = comm.world(group), comm.rank_in(group), q.shape[-2]
        window, softcap = mods
        acc = _acc(q)
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1] + (1,), NEG_INF, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for i in range(n):
            owner = (r - i) % n
            mask = _block_mask(r, owner, s, causal, window, key_pad_full, q.device)
            if mask is not False:  # False: every key of the block is hidden
                kb, vb = kv[0], kv[1]
                fused = dropout_p == 0 and softcap is None
                res = _block_fused(q, kb, vb, mask, scale) if fused else None
                if res is None:
                    keep = None
                    if dropout_p > 0:
                        keep = _keep_mask(seed, owner, q.shape[:-1] + (s,), q.device, dropout_p)
                    res = _block_plain(q, kb, vb, mask, scale, keep, dropout_p, softcap)
                out, lse = _merge(out, lse, *res)
            if i < n - 1:
                kv = _ring(kv, group)
        if sinks is not None:  # the sink's logit joins the denominator, its value is 0
            sink = sinks.to(acc).view(1, -1, 1, 1).expand_as(lse)
            out, lse = _merge(out, lse, torch.zeros_like(out), sink)
        ctx.save_for_backward(q, k, v, out, lse, key_pad_full, sinks)
        ctx.args = (group, causal, scale, dropout_p, seed, mods)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, key_pad_full, sinks = ctx.saved_tensors
        group, causal, scale, dropout_p, seed, (window, softcap) = ctx.args
        n, r, s = comm.world(group), comm.rank_in(group), q.shape[-2]
        acc = _acc(q)
        g = grad.to(acc)
        delta = (g * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O) = rowsum(dP * P)
        lse_safe = torch.where(torch.isinf(lse), float("inf"), lse)  # all-masked rows: P = 0
        qf = q.to(acc)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for i in range(n):
            owner = (r - i) % n
            mask = _block_mask(r, owner, s, causal, window, key_pad_full, q.device)
            if mask is not False:
                kb, vb = kv[0].to(acc), kv[1].to(acc)
                raw = (qf @ kb.transpose(-1, -2)) * scale
                sc = capped(raw, softcap)
                if mask is not None:
                    sc = sc.masked_fill(~mask, NEG_INF)
                p = torch.exp(sc - lse_safe)
                dp = g @ vb.transpose(-1, -2)
                pd = p
                if dropout_p > 0:
                    keep = _keep_mask(seed, owner, p.shape, q.device, dropout_p).to(acc)
                    keep = keep / (1 - dropout_p)
                    pd, dp = p * keep, dp * keep
                ds = p * (dp - delta) * scale
                if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
                    ds = ds * (1 - (sc.masked_fill(torch.isinf(sc), 0.0) / softcap) ** 2)
                dq += ds @ kb
                dkv[0] += ds.transpose(-1, -2) @ qf
                dkv[1] += pd.transpose(-1, -2) @ g
            if i < n - 1:
                kv = _ring(kv, group)
            dkv = _ring(dkv, group)  # n passes in all: back at the block's owner
        dsinks = None
        if sinks is not None:
            sink = sinks.to(acc).view(1, -1, 1, 1)
            dsinks = -(torch.exp(sink - lse_safe) * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
        grads = (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, dsinks)
        return *grads, *([None] * 6)


def _block_mask(r: int, owner: int, s: int, causal: bool, window, key_pad_full, device):
    """The mask of rank ``r``'s queries against ``owner``'s key block: None (every key seen),
    False (none: causality or the window hides the whole block), or a bool tensor."""
    if causal and owner > r:
        return False
    if window is not None and r * s - ((owner + 1) * s - 1) >= window:
        return False
    pad = None if key_pad_full is None else key_pad_full[:, _span(owner, s)]
    rows, cols = range(r * s, (r + 1) * s), _span_range(owner, s)
    mask = allowed_mask(rows, cols, causal and owner == r, pad, window)
    return None if mask is None else mask.to(device)


def _span_range(owner: int, s: int) -> range:
    return range(owner * s, (owner + 1) * s)


def _merge(out, lse, out_b, lse_b):
    """Combine two partial softmax results given as (normalised output, log-sum-exp)."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    return out * torch.exp(lse - safe) + out_b * torch.exp(lse_b - safe), new


def online_attention(
    q, k, v, group, causal, key_pad_full, dropout_p, scale, seed=0, *, window=None, softcap=None,
    sinks=None,
):  # fmt: skip
    """Memory-lean ring attention (online softmax); see ``RingOnlineAttention``."""
    mods = (window, softcap)
    return RingOnlineAttention.apply(
        q, k, v, key_pad_full, sinks, group, causal, scale, dropout_p, seed, mods
    )


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
