"""``nn.MultiheadAttention`` under a tensor mode: one layer that keeps MHA's parameters under
their names (``in_proj_weight``, ``in_proj_bias``, ``q/k/v_proj_weight``, ``bias_k``,
``bias_v``, ``out_proj.weight``, ``out_proj.bias``) and computes what MHA computes.

Each rank holds whole heads: the packed ``in_proj_weight`` ``[3E, E]`` is cut as three blocks
(q, k, v), each by heads, the way the mode cuts a packed Linear, so a rank projects its
heads' q, k and v with the mode's own Linear algebra; attention runs on those heads
(``attend.py``); ``out_proj`` is the mode's Linear reading the heads (1d: row-parallel).
Where the mode cuts positions rather than the batch (2d/2.5d/3d on ``[L, B, E]`` inputs), the
keys and values are all-gathered over the position blocks; under ``sequence`` they go round
the ring (``ring_attention``). The mode packages subclass ``ShardedMultiheadAttention`` with
their specs, Linear algebra and rows (``mode_1d/mha.py``, ``mode_2d/mha.py``,
``mode_3d/mha.py``, ``sequence/mha.py``).

Once any layer replaces an MHA, torch's fused inference paths (``torch.backends.mha``
fast path: ``nn.TransformerEncoderLayer``'s ``_transformer_encoder_layer_fwd``,
``nn.TransformerEncoder``'s nested tensors, MHA's own) are switched off for the process:
they read ``in_proj_weight`` and the layer's other weights directly, which are now shards.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import Tensor, nn

from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.base import ShardedModule, check_divisible
from gridtrain.parallel.tensor.mha.attend import additive, append_keys, attend, causal_mask
from gridtrain.parallel.tensor.mha.call import Call, Limits, read_call
from gridtrain.parallel.tensor.mha.rows import Rows, whole_mask
from gridtrain.parallel.tensor.modes import names_where
from gridtrain.parallel.tensor.plan import PlanError

logger = logging.getLogger("gridtrain")
WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
MASK_DIMS = "attn_mask must be 2-D [L, S] or 3-D [N * num_heads, L, S]"


class ShardedMultiheadAttention(ShardedModule):
    """Base of the modes' MHA layers (module docstring). A subclass sets ``limits``,
    ``rng_mode``, ``heads_split`` / ``head_rank`` before ``_build``, and implements the
    ``_weight_spec`` ... ``_linear`` hooks; ``rows`` (the attention's rows) and ``mask_rows``
    (the engine's batch split, which masks follow) are None where the mode cuts no rows."""

    limits: Limits
    rng_mode: ParallelMode
    ring = False  # positions split: ring attention instead of gathering keys and values
    explicit = False  # softmax(q k^T) v by matmuls, never through SDPA (which a mode may route)
    rows: Rows | None = None
    mask_rows: Rows | None = None

    def __init__(self, dense: nn.MultiheadAttention, ctx):
        if type(dense).forward is not nn.MultiheadAttention.forward:
            raise ValueError(
                f"{type(dense).__name__} overrides nn.MultiheadAttention.forward; gridtrain "
                "implements torch's forward only (give the module style 'replicate' under 1d)"
            )
        super().__init__(dense, ctx)
        for name in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout"):
            setattr(self, name, getattr(dense, name))
        self.batch_first, self.head_dim = dense.batch_first, dense.head_dim
        self.add_zero_attn = dense.add_zero_attn

    def _build(self, dense: nn.MultiheadAttention) -> None:
        """Register this rank's shards and ``out_proj``; called by the subclass's ``__init__``."""
        name = type(self).__name__
        check_divisible(name, "num_heads", self.num_heads, self.heads_split, "heads per rank")
        self.local_heads = self.num_heads // self.heads_split
        for w in WEIGHTS:
            packed = 3 if w == "in_proj_weight" else 1
            self.shard(w, self._weight_spec(packed) if getattr(dense, w) is not None else ())
        self.shard("in_proj_bias", self._bias_spec(0, 3))
        self.out_proj = self._out_proj(dense.out_proj)
        if dense.bias_k is not None and not self.limits.extra_keys:
            raise ValueError(f"{name}: add_bias_kv=True is not supported ({self.limits.mode})")
        if dense.add_zero_attn and not self.limits.extra_keys:
            raise ValueError(f"{name}: add_zero_attn=True is not supported ({self.limits.mode})")
        self.shard("bias_k", self._bias_spec(2, 1))
        self.shard("bias_v", self._bias_spec(2, 1))

    # ---- the mode's hooks ------------------------------------------------------------------
    def _weight_spec(self, packed: int):
        raise NotImplementedError

    def _bias_spec(self, dim: int, packed: int):
        raise NotImplementedError

    def _out_proj(self, dense: nn.Linear) -> nn.Module:
        raise NotImplementedError

    def _usable_weight(self, w: Tensor) -> Tensor:
        """A weight shard as this rank's matmul takes it (``[out block, in block]``)."""
        return w

    def _usable_bias(self, b: Tensor, dim: int) -> Tensor:
        """A bias shard as this rank adds it (its heads' block of ``dim``)."""
        return b

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        raise NotImplementedError

    def _out_width(self) -> int:
        """The last dim of this rank's output (its part of ``embed_dim``)."""
        return self.embed_dim

    def _combine_weights(self, probs: Tensor, average: bool) -> Tensor:
        raise PlanError(f"need_weights=True under {self.limits.mode}")

    # ---- forward ---------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or None)``."""
        call = read_call(
            self.limits,
            self.batch_first,
            query,
            key,
            value,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
        )
        if call.query.is_meta:  # the planner's dry run: this rank's shapes, no collectives
            return self._meta(call)
        q, k, v = (self._heads(t) for t in self._in_projection(call))
        out, probs = self._attention(call, q, k, v)
        out = self.out_proj(self._merge_heads(out))
        weights = (
            self._combine_weights(probs, call.average_attn_weights) if probs is not None else None
        )
        if not call.batched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _in_projection(self, call: Call) -> tuple[Tensor, Tensor, Tensor]:
        b = self.in_proj_bias
        b = None if b is None else self._usable_bias(b, 0)
        bias = (None,) * 3 if b is None else b.chunk(3)
        if self._qkv_same_embed_dim:
            w = self._usable_weight(self.in_proj_weight)
            if call.query is call.key and call.key is call.value:  # one matmul, as F does
                return self._linear(call.query, w, b).chunk(3, -1)
            ws = w.chunk(3)
        else:
            separate = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            ws = [self._usable_weight(p) for p in separate]
        xs = (call.query, call.key, call.value)
        return tuple(self._linear(x, w, bb) for x, w, bb in zip(xs, ws, bias, strict=True))

    def _heads(self, t: Tensor) -> Tensor:
        """The module's layout ``[..., h * D]`` as ``[B, h, L, D]``."""
        t = t.unflatten(-1, (self.local_heads, self.head_dim))
        return t.permute(0, 2, 1, 3) if self.batch_first else t.permute(1, 2, 0, 3)

    def _merge_heads(self, o: Tensor) -> Tensor:
        return (o.permute(0, 2, 1, 3) if self.batch_first else o.permute(2, 0, 1, 3)).flatten(2)

    @property
    def _positions_split(self) -> bool:
        """Whether this rank's rows are a block of positions (not of the batch)."""
        return self.rows is not None and (self.rows.dim == 0) != self.batch_first

    def _attention(self, call: Call, q: Tensor, k: Tensor, v: Tensor):
        p = self.dropout if self.training and not q.is_meta else 0.0
        if self._positions_split and self.ring:
            return self._ring(call, q, k, v, p), None
        if self._positions_split:  # every rank's queries meet every key
            k, v = self.rows.gather(k, 2), self.rows.gather(v, 2)
        keys = k.shape[2]
        mask = self._mask(call, q, keys)
        bias_k, bias_v = (
            None if t is None else self._usable_bias(t, 2) for t in (self.bias_k, self.bias_v)
        )
        k, v, mask = append_keys(k, v, mask, bias_k, bias_v, self.add_zero_attn)
        if call.is_causal:
            padded = call.key_padding_mask is not None or call.need_weights  # F's mask route
            offset = self.rows.index * q.shape[2] if self._positions_split else 0
            free = keys if padded else k.shape[2]
            cm = causal_mask(q.shape[2], k.shape[2], offset, free, q)
            mask = cm if mask is None else mask + cm
        with self._fork_rng(p):
            return attend(q, k, v, mask, call.need_weights, p, self.explicit)

    def _ring(self, call: Call, q: Tensor, k: Tensor, v: Tensor, p: float) -> Tensor:
        from gridtrain.parallel.tensor.sequence.attention import ring_attention

        if k.shape[2] != q.shape[2]:
            raise PlanError(
                f"nn.MultiheadAttention under tensor mode {self.limits.mode!r}: query and key "
                f"hold {q.shape[2]} and {k.shape[2]} positions on this rank; ring attention is "
                "attention between equally split sequences"
            )
        pad = call.key_padding_mask
        if pad is not None:
            whole = (q.shape[0], k.shape[2] * self.rows.parts)
            pad = boolean_padding(whole_mask(pad, whole, self.mask_rows, "key_padding_mask"))
            pad = self.rows.cut(pad, 1)
        return ring_attention(q, k, v, call.is_causal, pad, p, ctx=self.ctx)

    def _mask(self, call: Call, q: Tensor, keys: int) -> Tensor | None:
        """The key padding and attention masks of this rank's rows and heads, additive,
        broadcasting to ``[B, h, L, S]`` (``is_causal`` takes the mask to be causal, as
        torch's hint says, so its values are not read)."""
        rows, by_pos = self.rows, self._positions_split
        batch = q.shape[0] * (rows.parts if rows is not None and not by_pos else 1)
        length = q.shape[2] * (rows.parts if by_pos else 1)
        out = None
        if call.key_padding_mask is not None:
            pad = whole_mask(
                call.key_padding_mask, (batch, keys), self.mask_rows, "key_padding_mask"
            )
            pad = pad if rows is None or by_pos else rows.cut(pad, 0)
            out = additive(pad, q.dtype)[:, None, None, :]
        if call.attn_mask is None or call.is_causal:
            return out
        am = call.attn_mask
        if am.dim() == 2:
            am = whole_mask(am, (length, keys), self.mask_rows, "attn_mask")
            am = (rows.cut(am, 0) if by_pos else am)[None, None]
        elif am.dim() == 3:
            am = whole_mask(am, (batch * self.num_heads, length, keys), self.mask_rows, "attn_mask")
            am = self._head_block(am.unflatten(0, (batch, self.num_heads)))
            if rows is not None:
                am = rows.cut(am, 2) if by_pos else rows.cut(am, 0)
        else:
            raise PlanError(f"{MASK_DIMS}; got shape {list(am.shape)}")
        am = additive(am, q.dtype)
        return am if out is None else am + out

    def _head_block(self, t: Tensor) -> Tensor:
        """This rank's heads of ``t [B, H, ...]``."""
        return t.chunk(self.heads_split, dim=1)[self.head_rank]

    def _fork_rng(self, p: float):
        if p == 0.0 or self.ctx.world_size(self.rng_mode) == 1:
            return contextlib.nullcontext()
        return self.ctx.fork_rng(self.rng_mode)

    def _meta(self, call: Call) -> tuple[Tensor, Tensor | None]:
        """Shapes only (the planner's dry run on this rank's activations): the checks of a
        real call, attention on meta heads of this rank's shape, no collectives."""
        width = self.local_heads * self.head_dim
        q, k, v = (
            self._heads(t.new_empty(*t.shape[:-1], width))
            for t in (call.query, call.key, call.value)
        )
        out, probs = self._attention(call, q, k, v)
        out = call.query.new_empty(*call.query.shape[:-1], self._out_width())
        weights = None
        if probs is not None:
            b, _, length, keys = probs.shape
            weights = probs.new_empty(
                (b, length, keys)
                if call.average_attn_weights
                else (b, self.num_heads, length, keys)
            )
        if not call.batched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def release_dense(self) -> None:
        super().release_dense()
        no_fast_path()  # this layer now stands in the model (module docstring)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads} ({self.local_heads} here), "
            f"batch_first={self.batch_first}"
        )


def boolean_padding(pad: Tensor) -> Tensor:
    """A key padding mask as booleans (True = padding), for ring attention: a float one must
    hold only 0 and -inf (``nn.TransformerEncoderLayer`` turns a boolean one into that)."""
    if not pad.is_floating_point():
        return pad.bool()
    masked = pad == float("-inf")
    if not pad.is_meta and not bool(((pad == 0) | masked).all()):
        ring = names_where(lambda g: g.splits_sequence)
        raise PlanError(
            "key_padding_mask: a float mask with values other than 0 and -inf; ring attention "
            f"(tensor mode {ring}) takes padding only (True / -inf = padding)"
        )
    return masked


def no_fast_path() -> None:
    """Switch off torch's fused MHA / Transformer inference paths (module docstring)."""
    if torch.backends.mha.get_fastpath_enabled():
        torch.backends.mha.set_fastpath_enabled(False)
        logger.info(
            "gridtrain: nn.MultiheadAttention is sharded, so torch.backends.mha's fast path "
            "(which reads its weights directly) is off for this process"
        )
