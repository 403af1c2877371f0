"""One call of ``nn.MultiheadAttention.forward``, checked before anything is computed.

``read_call`` takes the arguments torch's MHA takes, refuses (``PlanError``, naming the
argument) what the sharded layer does not compute, and brings the inputs to the form the
layer works on: batched, in the module's own layout (``batch_first`` or not; the layer
cuts rows there). The same code runs on meta during the planner's dry run
(``local_shapes.py``), so a refused argument stops ``gt.initialize``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gridtrain.parallel.tensor.modes import names_where
from gridtrain.parallel.tensor.plan import PlanError


@dataclass
class Call:
    """A checked call: inputs batched in the module's layout, masks as given."""

    query: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor | None
    attn_mask: Tensor | None
    need_weights: bool
    average_attn_weights: bool
    is_causal: bool
    batched: bool


@dataclass(frozen=True)
class Limits:
    """What a sharded layer computes beyond ``need_weights=False`` on batched inputs."""

    mode: str
    weights: bool = False  # need_weights=True (the probabilities, averaged or per head)
    unbatched: bool = False  # 2-D query/key/value (no batch dim)
    extra_keys: bool = True  # add_bias_kv / add_zero_attn
    attn_mask: bool = True  # any attn_mask (else: only with is_causal=True, which ignores it)


def read_call(
    limits: Limits,
    batch_first: bool,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
) -> Call:
    """The checked call (module docstring); raises ``PlanError`` naming what is refused."""
    where = f"nn.MultiheadAttention under tensor mode {limits.mode!r}"
    if any(t.is_nested for t in (query, key, value)):
        raise PlanError(f"{where}: nested-tensor inputs are not supported")
    if need_weights and not limits.weights:
        # the modes that keep every row and position whole compute the attention weights
        whole = names_where(lambda g: not g.blocked and not g.splits_sequence)
        raise PlanError(
            f"{where}: need_weights=True (the default of nn.MultiheadAttention.forward) is not "
            "computed on sharded heads; call it with need_weights=False (as "
            f"nn.TransformerEncoderLayer and torchvision's ViT do), or use tensor mode {whole}"
        )
    if is_causal and attn_mask is None:
        raise PlanError(f"{where}: is_causal=True needs attn_mask, as in torch")
    if attn_mask is not None and not is_causal and not limits.attn_mask:
        raise PlanError(
            f"{where}: attn_mask (of shape {list(attn_mask.shape)}) without is_causal=True: "
            "ring attention applies causal masking and key padding only; pass is_causal=True "
            "with a causal mask, a key_padding_mask for padding, or use another tensor mode"
        )
    batched = query.dim() == 3
    if not batched:
        if query.dim() != 2 or not limits.unbatched:
            raise PlanError(
                f"{where}: query of shape {list(query.shape)}; expected [N, L, E] or [L, N, E]"
                + (" (or unbatched [L, E])" if limits.unbatched else "")
            )
        dim = 0 if batch_first else 1  # batch_first is ignored for unbatched inputs
        query, key, value = (t.unsqueeze(dim) for t in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    if key.dim() != 3 or value.dim() != 3:
        raise PlanError(
            f"{where}: key {list(key.shape)} and value {list(value.shape)} must be 3-D like "
            f"query {list(query.shape)}"
        )
    return Call(
        query,
        key,
        value,
        key_padding_mask,
        attn_mask,
        need_weights,
        average_attn_weights,
        is_causal,
        batched,
    )
