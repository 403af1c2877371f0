"""Attention over the whole sequence from this rank's positions: ring self-attention under
'sequence' (``parallel.tensor.ring_attention`` picks the variant), SDPA otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.sequence.layout import (
    SEQUENCE,
    current_ctx,
    sequence_group,
    splits_sequence,
)
from gridtrain.parallel.tensor.sequence.ring import (
    allowed_mask,
    capped,
    default_scale,
    online_attention,
    softmax_probs,
    standard_attention,
)

VARIANTS = ("standard", "online")


def _dense_attention(q, k, v, causal, key_padding_mask, dropout_p, scale, window, softcap, sinks):
    s = q.shape[-2]
    mask = allowed_mask(range(s), range(k.shape[-2]), causal, key_padding_mask, window)
    if mask is not None:
        mask = mask.to(q.device)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
        )
    probs = softmax_probs(capped((q @ k.transpose(-1, -2)) * scale, softcap), mask, sinks, q.dtype)
    return F.dropout(probs, dropout_p) @ v


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    variant: str | None = None,
    ctx: ParallelContext | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Softmax attention over the whole sequence from this rank's ``[B, H, s, D]`` shards.

    Without sequence parallelism this is ``scaled_dot_product_attention``, so model
    code calls it unconditionally. ``key_padding_mask``: ``[B, s]`` bool of this
    rank's keys, True = padding (as ``nn.MultiheadAttention``). ``variant``:
    'standard' (RingQK/RingAV, ``s x S`` scores) or 'online' (online softmax,
    one ``s x s`` block at a time); None reads ``parallel.tensor.ring_attention``.
    Rows whose keys are all masked give zeros under 'online' and NaN elsewhere.
    ``window`` (with ``causal``): each query sees the ``window`` keys ending at itself;
    ``softcap``: scaled scores become ``softcap * tanh(scores / softcap)``; ``sinks``
    (``[H]``): a logit per head in each row's softmax denominator that attends to nothing.
    """
    key_padding_mask = _checked(q, k, v, causal, key_padding_mask, window, sinks)
    ctx = current_ctx(ctx)
    if variant is None:
        variant = ctx.config.parallel.tensor.ring_attention if ctx is not None else "standard"
    if variant not in VARIANTS:
        raise ValueError(f"ring_attention: variant must be one of {VARIANTS}, got {variant!r}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    mods = dict(window=window, softcap=softcap, sinks=sinks)
    if not splits_sequence(ctx):
        return _dense_attention(q, k, v, causal, key_padding_mask, dropout_p, scale, **mods)
    if q.is_meta:  # the planner's dry run: shapes only, no collectives
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))
    group = sequence_group(ctx)
    if key_padding_mask is not None:  # [B, S] bools are tiny next to the keys: gather them
        key_padding_mask = comm.all_gather_raw(key_padding_mask.to(torch.uint8), 1, group).bool()
    if variant == "standard":
        with ctx.fork_rng(SEQUENCE):
            return standard_attention(
                q, k, v, group, causal, key_padding_mask, dropout_p, scale, **mods
            )
    seed = 0
    if dropout_p > 0:
        with ctx.fork_rng(SEQUENCE):
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item())
    return online_attention(
        q, k, v, group, causal, key_padding_mask, dropout_p, scale, seed, **mods
    )


def _checked(q, k, v, causal, key_padding_mask, window, sinks) -> Tensor | None:
    """The bool key padding mask, once every shape and argument is checked (ValueError)."""
    if q.dim() != 4 or k.shape != q.shape[:-1] + (k.shape[-1],) or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"ring_attention: q, k, v must be [B, H, s, D] with equal B, H, s; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if window is not None and (not causal or window < 1):
        raise ValueError(f"ring_attention: window={window} needs causal=True and window >= 1")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"ring_attention: sinks must be [H] = [{q.shape[1]}], got {sinks.shape}")
    if key_padding_mask is None:
        return None
    if key_padding_mask.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"ring_attention: key_padding_mask must be [B, s] = {(q.shape[0], q.shape[2])}, "
            f"got {tuple(key_padding_mask.shape)}"
        )
    return key_padding_mask.bool()
