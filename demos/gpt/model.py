"""A GPT-2 family model written once with ``gt.nn`` layers; the config picks the parallelism.

Layout (also the pipeline cut list): ``GPT`` is an ``nn.Sequential`` of

    embed          token (vocab-parallel) + position embeddings, dropout
    h0 .. h{L-1}   pre-norm transformer blocks (causal self-attention, GELU MLP)
    head           final LayerNorm + classifier whose weight *is* ``embed.tok.weight``

so ``list(model)`` (or ``model.pipeline_layers()``) is the ordered layer list a
pipeline partitioner cuts. The head reuses the embedding's Parameter object:
when embed and head land on different stages, the tie must be kept by a
shared-module gradient handler (the state dict lists the tensor under both keys).

Attention is tensor-parallel by construction. Each block creates its Linears in
the order qkv, proj, fc, fc2; under 1d consecutive ``gt.nn.Linear``\\s alternate
column- then row-parallel, so qkv's output (and fc's) is split over the tensor
group and proj (and fc2) reduce it back. The dense qkv weight is laid out *head
by head* (rows ``[head, (q, k, v), head_dim]``, unlike Hugging Face's
``[(q, k, v), head, head_dim]``), so any contiguous split of its output is a
whole number of heads with their own q, k and v. Attention derives its local
head count from the local qkv width, so the same code runs unsharded, under 1d
and under the 2d/2.5d/3d layouts whose Linears split the hidden dimension.
Under 'sequence' each rank holds a block of positions: attention becomes ring
attention, positions start at the block's offset and the loss takes ``[B, V, S]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gridtrain as gt
import gridtrain.nn as gnn
from gridtrain.parallel.context import get_context, has_context, set_context
from gridtrain.parallel.sharding import full_state_dict, get_shard_spec, shard_tensor
from gridtrain.parallel.tensor import sequence
from gridtrain.parallel.tensor.sequence import ring_attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Architecture of one GPT-2 family model."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256  # longest sequence (rows of the position embedding)
    vocab_size: int = 256  # 256 = byte level; GPT-2 BPE is 50257, padded to 50304
    dropout: float = 0.0  # residual, embedding and attention-probability dropout
    bias: bool = True  # biases in the Linears (GPT-2 has them; LayerNorms always do)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self, embeddings: bool = True) -> int:
        """Dense parameter count (tied head counted once); ``embeddings=False`` drops the
        position table, the convention of the 6·N·tokens FLOP estimate (nanoGPT, PaLM)."""
        h, b = self.n_embd, int(self.bias)
        block = 12 * h * h + b * 9 * h + 4 * h  # qkv+proj+fc+fc2 (+ biases), 2 LayerNorms
        n = self.vocab_size * h + self.n_layer * block + 2 * h
        return n + (self.block_size * h if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N plus causal-agnostic attention 12·L·H·S (PaLM, B.)."""
        return 6 * self.num_params(embeddings=False) + 12 * self.n_layer * self.n_embd * seq_len


PRESETS = {
    "tiny": GPTConfig(),  # ~0.8M: CPU demo and tests
    "small": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A preset (tiny, small = GPT-2 124M, medium = GPT-2 350M) with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention on whichever heads this rank's qkv shard holds."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = gnn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = gnn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = gnn.Dropout(cfg.dropout)
        self.ring = _tensor_mode() == "sequence"  # decided at build time, as the layers are

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # [B, S, 3 * local heads * head_dim], head-major
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        p = self.dropout if self.training else 0.0
        if self.ring:  # this rank holds a block of positions: ring attention
            y = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), True, dropout_p=p)
        else:
            with _tensor_rng(p):
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, heads * self.head_dim)
        return self.resid_drop(self.proj(y))


def _tensor_mode() -> str | None:
    return gt.get_context().tensor_mode if has_context() else None


def _tensor_rng(p: float):
    """Heads are split over the tensor group, so each rank draws its own attention mask."""
    if p > 0 and has_context() and gt.get_context().tensor_parallel_size > 1:
        return gt.get_context().fork_rng(gt.ParallelMode.TENSOR)
    return contextlib.nullcontext()


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = gnn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc2 = gnn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = gnn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = gnn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = gnn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    """``tok[idx] + pos[0..S)`` for token ids ``[B, S]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = gnn.VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd)
        self.pos = gnn.VocabParallelEmbedding(cfg.block_size, cfg.n_embd)
        self.drop = gnn.Dropout(cfg.dropout)
        self.sequence_blocks = _tensor_mode() == "sequence"

    def forward(self, idx: Tensor) -> Tensor:
        if idx.shape[-1] > self.block_size:
            raise ValueError(
                f"sequence length {idx.shape[-1]} exceeds block_size {self.block_size}"
            )
        # positions take the token tensor's shape, so any batch split applies to both alike;
        # under 'sequence' this rank's tokens start at its block's offset
        if self.sequence_blocks:
            pos = sequence.position_ids(idx.shape[-1], idx.device)
        else:
            pos = torch.arange(idx.shape[-1], device=idx.device)
        pos = pos.expand_as(idx)
        return self.drop(self.tok(idx) + self.pos(pos))


class Head(nn.Module):
    """Final LayerNorm and the classifier tied to the token embedding (logits may be
    sharded over the vocabulary; ``GPTLoss`` takes them as they are)."""

    def __init__(self, cfg: GPTConfig, tok_weight: nn.Parameter):
        super().__init__()
        self.ln_f = gnn.LayerNorm(cfg.n_embd)
        self.classifier = gnn.VocabParallelClassifier(
            cfg.n_embd, cfg.vocab_size, weight=tok_weight, bias=False
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.ln_f(x))


class GPT(nn.Sequential):
    """GPT-2: ``embed, h0..h{L-1}, head`` in order; token ids ``[B, S]`` -> logits ``[B, S, V]``."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        embed = Embed(cfg)
        layers = [("embed", embed)]
        layers += [(f"h{i}", Block(cfg)) for i in range(cfg.n_layer)]
        layers.append(("head", Head(cfg, embed.tok.weight)))
        super().__init__(OrderedDict(layers))
        self.cfg = cfg
        init_weights(self, cfg, seed)

    def pipeline_layers(self) -> list[nn.Module]:
        """The ordered layers a pipeline partitioner may cut between."""
        return list(self)


class GPTLoss(nn.Module):
    """Next-token cross entropy of ``[B, S, V]`` logits and ``[B, S]`` targets.

    The tensor-parallel losses take classes on the last dim (and recognise their
    sharded logits by tags a reshape would lose); torch's own wants ``[N, V]``;
    the sequence-parallel one ``[B, V, S_local]`` (its mean covers the whole sequence).
    """

    def __init__(self):
        super().__init__()
        self.ce = gnn.CrossEntropyLoss()
        self.flatten = type(self.ce) is nn.CrossEntropyLoss
        self.class_dim_1 = _tensor_mode() == "sequence"  # [B, V, S_local] with its token labels

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        if self.flatten:
            return self.ce(logits.flatten(0, -2), targets.flatten())
        if self.class_dim_1:
            return self.ce(logits.transpose(1, 2), targets)
        return self.ce(logits, targets)


def _init_std(key: str, cfg: GPTConfig) -> float | None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L); None = not normal."""
    if key.endswith(".bias") or ".ln_" in key:
        return None
    if key.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    return 0.02


@torch.no_grad()
def init_weights(model: nn.Module, cfg: GPTConfig, seed: int = 0) -> None:
    """Draw every *dense* tensor from one seeded CPU generator, then keep this rank's shard.

    The weights therefore equal those of the model built with no parallelism,
    whatever the layout (a layer's own init would depend on its shard shape).
    """
    gen = torch.Generator().manual_seed(seed)
    ctx = gt.get_context() if has_context() else None
    seen: set[int] = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # the tied classifier weight
            continue
        seen.add(id(t))
        spec = get_shard_spec(t)
        shape = _dense_shape(t, spec, ctx)
        std = _init_std(key, cfg)
        if std is not None:
            full = torch.empty(shape).normal_(0.0, std, generator=gen)
        elif key.endswith(".weight"):  # LayerNorm scale
            full = torch.ones(shape)
        else:
            full = torch.zeros(shape)
        if spec:
            full = shard_tensor(full, spec, ctx)
        t.copy_(full.to(t.dtype))


def _dense_shape(t: Tensor, spec, ctx) -> list[int]:
    shape = list(t.shape)
    for dim, mode in spec:
        shape[dim] *= ctx.world_size(mode)
    return shape


@contextlib.contextmanager
def dense_layers():
    """Inside the block ``gt.nn`` builds unsharded layers even where a parallel context is
    current (for a rank-local dense copy, e.g. to sample from ``gt.full_state_dict``)."""
    saved = get_context() if has_context() else None
    set_context(None)
    try:
        yield
    finally:
        set_context(saved)


def dense_copy(model: nn.Module, cfg: GPTConfig, device: torch.device | str = "cpu") -> GPT:
    """A single-process GPT holding ``model``'s full weights (collective: call on every rank)."""
    state = full_state_dict(model)
    with dense_layers():
        dense = GPT(cfg)
    dense.load_state_dict(state)
    return dense.to(device)


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` continuations of ``idx [B, S]`` from a dense ``model``
    (top-k sampling; ``temperature=0`` is greedy)."""
    block_size = model.cfg.block_size
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx
