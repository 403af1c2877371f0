"""Sequence parallelism inside a Hugging Face model: ring attention through ``transformers``'
attention-function registry, and global positions for each rank's block of tokens.

Models that support attention backends (``_supports_attention_backend``: GPT-2, the
Llama family) call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and build
their masks with ``ALL_MASK_ATTENTION_FUNCTIONS[...]``. gridtrain registers both under
``"gridtrain_ring"`` (``AttentionInterface.register`` / ``AttentionMaskInterface.register``)
and switches the model to it, so the model's own code runs ring attention:

* the mask function hands on the 2-D padding mask of this rank's keys (``[B, S/N]``,
  True = attend) instead of building an ``S/N x S/N`` block that cannot see the other
  ranks' keys; causality is applied by ring attention from the global positions;
* the attention function repeats grouped key/value heads (GQA) and calls
  ``gridtrain.parallel.tensor.sequence.ring_attention``;
* a forward pre-hook passes ``position_ids`` starting at this rank's offset
  (``gt.nn.position_ids``), so learned (GPT-2) and rotary (Llama) positions are global,
  and refuses ``labels=``: HF's loss shifts labels by one inside the model, which would
  cross shards; labels are shifted by the user before the batch is split.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.parallel.tensor.sequence import position_ids as sequence_positions
from gridtrain.parallel.tensor.sequence import ring_attention

NAME = "gridtrain_ring"


def ring_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``transformers``' attention signature: ``[B, H, s, D]`` in, ``[B, s, H, D]`` out."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: one kv head per group
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"ring attention takes a [batch, keys] padding mask, got a mask of shape "
            f"{tuple(attention_mask.shape)} (a prepared 4-D mask cannot span the ring)"
        )
    padding = None if attention_mask is None else ~attention_mask.bool()
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = ring_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), causal, padding, dropout, scaling
    )
    return out.transpose(1, 2).contiguous(), None


def ring_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    config=None,
    **kwargs: Any,
) -> Tensor | None:
    """The mask function for ``NAME``: this rank's ``[B, S/N]`` padding mask (or None)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if q_offset or kv_offset or q_length != kv_length:
        raise NotImplementedError(
            "ring attention runs on whole training sequences: a key/value cache (generation) "
            "is not supported under sequence parallelism"
        )
    if mask_function not in (causal_mask_function, bidirectional_mask_function, None):
        window = getattr(config, "sliding_window", None)
        from gridtrain.parallel.context import get_context

        total = kv_length * get_context().world_size(ParallelMode.SEQUENCE)
        if window is None or window < total:
            raise NotImplementedError(
                f"sequence parallelism: this model asks for a non-causal mask pattern "
                f"(sliding window {window}, or packed sequences) shorter than the sequence "
                f"({total}); ring attention applies causal and padding masks only"
            )
    return attention_mask


def install(model: nn.Module, ctx: ParallelContext) -> None:
    """Switch ``model`` to ring attention and global positions (tensor mode 'sequence')."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):  # older checks: set the config field directly
        model.config._attn_implementation = NAME
    if model.config._attn_implementation != NAME:
        raise PlanError(f"{type(model).__name__}: could not switch attention to ring attention")
    model.register_forward_pre_hook(_global_positions(ctx), with_kwargs=True)


def _global_positions(ctx: ParallelContext):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("labels") is not None:
            raise ValueError(
                "sequence parallelism: do not pass labels= to the model (its internal shift "
                "would cross shards); shift the labels yourself and give them to "
                "engine.criterion(out, labels)"
            )
        if kwargs.get("position_ids") is not None:
            return None  # given by the user: split with the batch like every [B, S] tensor
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if not isinstance(tokens, Tensor):
            return None
        kwargs["position_ids"] = sequence_positions(tokens.shape[1], tokens.device, ctx)[None]
        return args, kwargs

    return hook
