"""The attention of ``nn.MultiheadAttention`` on this rank's heads, as torch computes it.

``F.multi_head_attention_forward`` projects q, k, v, then per head: appends ``bias_k`` /
``bias_v`` and a zero key (``add_zero_attn``) with their mask columns, merges the key padding
mask into the attention mask (boolean masks become ``-inf`` additive ones), and either runs
``scaled_dot_product_attention`` (``need_weights=False``) or the explicit
``softmax(q k^T / sqrt(d) + mask) v`` whose probabilities it returns. Heads are independent,
so the same steps on a rank's heads give that rank's heads of the dense result; what
differs is only where the query rows sit in the whole sequence (``q_offset``: a causal
mask over split positions) and which masks rows belong to the rank (``masks.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")


def additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True = masked) as an additive float one, as ``F._canonical_mask``; a
    float mask as it is."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, NEG_INF)


def causal_mask(rows: int, cols: int, q_offset: int, free_from: int, like: Tensor) -> Tensor:
    """Additive ``[rows, cols]`` in ``like``'s dtype: query ``q_offset + i`` sees key
    ``j <= q_offset + i`` (SDPA's top-left ``is_causal``), and every key ``j >= free_from``
    (appended ``bias_k`` / zero keys where torch pads the mask with zeros)."""
    i = torch.arange(rows, device=like.device)[:, None] + q_offset
    j = torch.arange(cols, device=like.device)[None, :]
    allowed = (j <= i) | (j >= free_from)
    out = torch.zeros(rows, cols, dtype=like.dtype, device=like.device)
    return out.masked_fill_(~allowed, NEG_INF)


def append_keys(k, v, mask, bias_k, bias_v, zero_attn: bool):
    """``k, v [B, h, S, D]`` with ``bias_k``/``bias_v`` (``[h, D]``) and a zero key appended, and
    the additive ``mask [..., S]`` padded with a zero column for each (F's order)."""
    b, h, _, d = k.shape
    extra = []
    if bias_k is not None:
        extra.append((bias_k.reshape(1, h, 1, d), bias_v.reshape(1, h, 1, d)))
    if zero_attn:
        zeros = k.new_zeros(1, h, 1, d)
        extra.append((zeros, zeros.to(v.dtype)))
    for ek, ev in extra:
        k = torch.cat([k, ek.expand(b, h, 1, d)], dim=2)
        v = torch.cat([v, ev.expand(b, h, 1, v.shape[-1])], dim=2)
        if mask is not None:
            mask = F.pad(mask, (0, 1))
    return k, v, mask


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    need_weights: bool,
    dropout_p: float,
    explicit: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(out [B, h, L, D], probabilities [B, h, L, S] or None)`` for ``q [B, h, L, D]``,
    ``k, v [B, h, S, D]`` and an additive ``mask`` broadcasting to ``[B, h, L, S]``:
    ``scaled_dot_product_attention`` without weights, else (or when ``explicit``) F's
    explicit form."""
    if not need_weights and not explicit:
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p), None
    scores = (q * math.sqrt(1.0 / float(q.shape[-1]))) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v, probs if need_weights else None
