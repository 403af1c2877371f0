"""A plain model's ``F.scaled_dot_product_attention`` as ring attention under 'sequence'.

Under sequence parallelism each rank holds ``S / N`` positions, so torch's SDPA would
attend only within the rank's own block: silently another model. ``SequenceAttention`` is a
``TorchFunctionMode`` that the engine enters around every forward (``attention_route``):
it sends each SDPA call (``F.scaled_dot_product_attention``, which is
``torch._C._nn.scaled_dot_product_attention``) to the same ring attention as
``gt.nn.attention``. Why a mode rather than patching ``F``: it catches every way the
function is reached (``from torch.nn.functional import scaled_dot_product_attention``
too), needs no knowledge of the model, and ``torch.compile`` traces through an active
mode, so compiled blocks keep it. Activation checkpointing replays a block in the backward,
outside the engine's forward, so the recompute enters it again (``replay_route``).

Arguments map onto ring attention: ``is_causal`` (causal over global positions),
``dropout_p`` (drawn from the SEQUENCE stream), ``scale``, ``enable_gqa`` (key/value heads
repeated per group) and a boolean ``attn_mask`` that masks keys only (``[B|1, 1, 1, s]``
or anything that broadcasts like it: a key padding mask, True = attend). A mask with a
query dimension, a float mask, or query and key of different lengths raise
``SequenceAttentionError`` naming the argument; the planner's dry run
(``local_shapes.check_routed_attention``) raises it before training where it can.
``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) computes its scores
without SDPA by default, so it is refused by name rather than left wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import _get_current_function_mode_stack

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.sequence.attention import ring_attention
from gridtrain.parallel.tensor.sequence.layout import ForwardMode, splits_sequence

INSTEAD = (
    "call gt.nn.attention(q, k, v, causal=..., key_padding_mask=...) (ring attention) "
    "or use a layout without sequence parallelism"
)


class SequenceAttentionError(ValueError):
    """An attention call that ring attention cannot compute as the dense model would;
    ``function`` is the refused function's name."""

    def __init__(self, message: str, function: str = "scaled_dot_product_attention"):
        super().__init__(message)
        self.function = function


class SequenceAttention(ForwardMode):
    """Routes ``scaled_dot_product_attention`` to ring attention over ``ctx``'s SEQUENCE
    group (module docstring). Other functions pass through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            raise SequenceAttentionError(
                "nn.MultiheadAttention under sequence parallelism would attend only within "
                "this rank's block of positions; compute q, k, v with Linears and "
                f"F.scaled_dot_product_attention (routed to ring attention), or {INSTEAD}",
                "multi_head_attention_forward",
            )
        return func(*args, **kwargs)

    def attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """``F.scaled_dot_product_attention``'s signature, computed by ring attention."""
        if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
            raise SequenceAttentionError(
                f"scaled_dot_product_attention under sequence parallelism takes [B, H, s, D] "
                f"(or [B, s, D]) query, key and value; got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}; {INSTEAD}"
            )
        headless = query.dim() == 3
        if headless:
            query, key, value = query[:, None], key[:, None], value[:, None]
        key, value = _grouped(query, key, value, enable_gqa)
        if query.shape[-2] != key.shape[-2]:
            raise SequenceAttentionError(
                f"scaled_dot_product_attention: query and key hold {query.shape[-2]} and "
                f"{key.shape[-2]} positions on this rank; ring attention is self-attention over "
                f"the split sequence (each rank's queries and keys are the same positions); "
                f"{INSTEAD}"
            )
        padding = _key_padding(attn_mask, query.shape[0], key.shape[-2])
        q, k, v = (t.contiguous() for t in (query, key, value))
        out = ring_attention(q, k, v, is_causal, padding, dropout_p, scale, ctx=self.ctx)
        return out[:, 0] if headless else out


def _grouped(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
    """Key and value with one head per query head (grouped-query attention repeats each)."""
    hq, hk = query.shape[1], key.shape[1]
    if hq == hk:
        return key, value
    if not enable_gqa or hq % hk or value.shape[1] != hk:
        raise SequenceAttentionError(
            f"scaled_dot_product_attention: {hq} query heads and {hk} key / "
            f"{value.shape[1]} value heads need enable_gqa=True and a query head count that "
            "the key/value head count divides"
        )
    return key.repeat_interleave(hq // hk, 1), value.repeat_interleave(hq // hk, 1)


def _key_padding(mask: Tensor | None, batch: int, keys: int) -> Tensor | None:
    """``[B, s]`` True = padding from a boolean ``attn_mask`` that masks keys only."""
    if mask is None:
        return None
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape) if mask.dim() <= 4 else mask.shape
    keys_only = len(shape) == 4 and shape[1] == shape[2] == 1 and shape[3] == keys
    if mask.dtype != torch.bool or not keys_only or shape[0] not in (1, batch):
        raise SequenceAttentionError(
            f"scaled_dot_product_attention: attn_mask of shape {tuple(mask.shape)} and dtype "
            f"{mask.dtype} cannot be applied under sequence parallelism: it covers only this "
            f"rank's {keys} keys, and ring attention takes a boolean mask over keys only "
            f"([B, 1, 1, {keys}], True = attend; use is_causal=True for causal masking); "
            f"{INSTEAD}"
        )
    return ~mask.reshape(shape[0], keys).expand(batch, keys)


def attention_route(ctx: ParallelContext) -> contextlib.AbstractContextManager:
    """The context a forward runs in under ``ctx``: ``SequenceAttention`` where a sequence
    group of more than one rank splits the positions, else nothing."""
    if not splits_sequence(ctx):
        return contextlib.nullcontext()
    return SequenceAttention(ctx)


def replay_route() -> Callable[[], contextlib.AbstractContextManager]:
    """Called in a forward: a factory of the routing active now, for a recompute of that
    forward in the backward (where the engine's forward context is gone)."""
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, SequenceAttention):
            ctx = mode.ctx
            return lambda: SequenceAttention(ctx)
    return contextlib.nullcontext
