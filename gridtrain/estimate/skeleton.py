"""The model a ``ModelSpec`` describes, written once in plain PyTorch with ``gt.nn`` hints.

The estimator builds it on the meta device and lets the engine's own planner
(``parallel.tensor.parallelize.build_plan``) shard it for a layout, so every
per-rank parameter shape comes from the modes' shard specs, never from a second
copy of their arithmetic. The tests train the very same class through
``gt.initialize`` and compare. Layout (also the pipeline cut list, as in
``demos/gpt``): an ``nn.Sequential`` of ``embed, h0 .. h{L-1}, head``.

* ``qkv`` is one Linear laid out *group by group*: for each key/value head, its
  query heads, then its key and its value (``[kv, q_per_kv + 2, head_dim]``), so
  any contiguous split of its output keeps whole groups (1d column split, the
  2d/2.5d/3d hidden blocks) and attention reads its local heads off the width.
* ``fc`` of a gated MLP interleaves gate and up (``[ffn, 2]``), for the same reason.
* Attention is ``gt.nn.attention``: SDPA, or ring attention under sequence parallelism.
* A spec with ``experts`` has gridtrain's ``MoeLayer`` as every block's ``mlp`` (top-1 or
  top-2 router at capacity factor 1, the grouped dispatch, ``Experts`` of ``expert_ffn``),
  built with the current context when there is one (its experts are then this rank's).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gridtrain.nn as gnn
from gridtrain.estimate.models import ModelSpec
from gridtrain.parallel import moe
from gridtrain.parallel.context import get_context, has_context


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.group = spec.heads // spec.num_kv_heads  # query heads per key/value head
        self.qkv = gnn.Linear(spec.hidden, spec.qkv_out, bias=spec.bias)
        self.proj = gnn.Linear(spec.hidden, spec.hidden, bias=spec.bias)
        self.drop = gnn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)
        b, s, width = qkv.shape
        kv = width // ((self.group + 2) * self.head_dim)  # key/value heads on this rank
        qkv = qkv.view(b, s, kv, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(b, s, kv * self.group, self.head_dim)
        k = qkv[:, :, :, self.group]
        v = qkv[:, :, :, self.group + 1]
        if self.group > 1:  # grouped-query attention: each kv head serves its group
            k = k.repeat_interleave(self.group, dim=2)
            v = v.repeat_interleave(self.group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = gnn.attention(q, k, v, causal=True)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gated = spec.gated
        out = spec.ffn_dim * (2 if spec.gated else 1)
        self.fc = gnn.Linear(spec.hidden, out, bias=spec.bias)
        self.fc2 = gnn.Linear(spec.ffn_dim, spec.hidden, bias=spec.bias)
        self.drop = gnn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.gated:
            gate, up = h.view(*h.shape[:-1], -1, 2).unbind(-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.fc2(h))


def moe_mlp(spec: ModelSpec) -> nn.Module:
    """The MoE layer of a block: ``spec.experts`` experts, ``spec.top_k`` per token."""
    ctx = get_context() if has_context() else None
    router_type = moe.Top2Router if spec.top_k == 2 else moe.Top1Router
    router = router_type(capacity_factor_train=1.0, capacity_factor_eval=1.0, min_capacity=1)
    act = F.silu if spec.gated else F.gelu
    experts = moe.Experts(spec.experts, spec.hidden, spec.expert_ffn, activation=act, ctx=ctx)
    return moe.MoeLayer(spec.hidden, spec.experts, router, experts, ctx=ctx)


def _norm(spec: ModelSpec) -> nn.Module:
    return gnn.LayerNorm(spec.hidden) if spec.norm == "layer" else gnn.RMSNorm(spec.hidden)


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm1, self.attn = _norm(spec), Attention(spec)
        self.norm2, self.mlp = _norm(spec), (moe_mlp(spec) if spec.experts else MLP(spec))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    """Token embedding (vocabulary split), plus learned positions when the spec has them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = gnn.VocabParallelEmbedding(spec.vocab, spec.hidden)
        self.pos = (
            gnn.VocabParallelEmbedding(spec.positions, spec.hidden) if spec.positions else None
        )
        self.drop = gnn.Dropout(spec.dropout)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids)
        if self.pos is not None:  # positions take the ids' shape: any batch split applies alike
            x = x + self.pos(gnn.position_ids(ids.shape[-1], ids.device).expand_as(ids))
        return self.drop(x)


class Head(nn.Module):
    """Final norm and the vocabulary-parallel LM head (tied to the token embedding if asked)."""

    def __init__(self, spec: ModelSpec, tok: nn.Embedding):
        super().__init__()
        self.norm = _norm(spec)
        weight = tok.weight if spec.tied else None
        self.classifier = gnn.VocabParallelClassifier(
            spec.hidden, spec.vocab, weight=weight, bias=False
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.norm(x))


class Decoder(nn.Sequential):
    """``embed, h0 .. h{L-1}, head``: token ids ``[B, S]`` -> logits ``[B, S, V]``."""

    def __init__(self, spec: ModelSpec):
        embed = Embed(spec)
        layers: list[tuple[str, nn.Module]] = [("embed", embed)]
        layers += [(f"h{i}", Block(spec)) for i in range(spec.layers)]
        layers.append(("head", Head(spec, embed.tok)))
        super().__init__(OrderedDict(layers))
        self.spec = spec


def meta_skeleton(spec: ModelSpec) -> Decoder:
    """Embed, one block and the head on the meta device: every block has the same shapes."""
    with torch.device("meta"):
        return Decoder(dataclasses.replace(spec, layers=1))
