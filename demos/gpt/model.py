"""A GPT-2 family model written once with ``gt.nn`` layers; the config picks the parallelism.

Layout (also the pipeline cut list): ``GPT`` is an ``nn.Sequential`` of

    embed          token (vocab-parallel) + position embeddings, dropout
    h0 .. h{L-1}   pre-norm transformer blocks (causal self-attention, GELU MLP)
    head           final LayerNorm + classifier whose weight *is* ``embed.tok.weight``

so ``list(model)`` (or ``model.pipeline_layers()``) is the ordered layer list a
pipeline partitioner cuts. The head reuses the embedding's Parameter object:
when embed and head land on different stages, the tie must be kept by a
shared-module gradient handler (the state dict lists the tensor under both keys).

The model is plain PyTorch with ``gt.nn`` hints; ``gt.initialize`` shards it as
the config says. Under 1d the traced plan makes qkv and fc column-parallel and
proj and fc2 row-parallel. The dense qkv weight is laid out *head by head*
(rows ``[head, (q, k, v), head_dim]``, unlike Hugging Face's
``[(q, k, v), head, head_dim]``), so any contiguous split of its output is a
whole number of heads with their own q, k and v. Attention derives its local
head count from the local qkv width, so the same code runs unsharded, under 1d
and under the 2d/2.5d/3d layouts whose Linears split the hidden dimension.
Under 'sequence' each rank holds a block of positions: ``gt.nn.attention`` is
ring attention and ``gt.nn.position_ids`` starts at the block's offset.
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
from gridtrain.parallel.context import get_context, has_context, set_context


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
        self.qkv = gt.nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = gt.nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = gt.nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # [B, S, 3 * local heads * head_dim], head-major
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        p = self.dropout if self.training else 0.0
        if _tensor_mode() == "sequence":  # this rank holds a block of positions: ring attention
            y = gt.nn.attention(q.contiguous(), k.contiguous(), v.contiguous(), True, dropout_p=p)
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
        self.fc = gt.nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc2 = gt.nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = gt.nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = gt.nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = gt.nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    """``tok[idx] + pos[0..S)`` for token ids ``[B, S]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = gt.nn.VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd)
        self.pos = gt.nn.VocabParallelEmbedding(cfg.block_size, cfg.n_embd)
        self.drop = gt.nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.shape[-1] > self.block_size:
            raise ValueError(
                f"sequence length {idx.shape[-1]} exceeds block_size {self.block_size}"
            )
        # positions take the token tensor's shape, so any batch split applies to both alike;
        # under 'sequence' this rank's tokens start at its block's offset
        pos = gt.nn.position_ids(idx.shape[-1], idx.device).expand_as(idx)
        return self.drop(self.tok(idx) + self.pos(pos))


class Head(nn.Module):
    """Final LayerNorm and the classifier tied to the token embedding (logits may be
    sharded over the vocabulary; ``GPTLoss`` takes them as they are)."""

    def __init__(self, cfg: GPTConfig, tok_weight: nn.Parameter):
        super().__init__()
        self.ln_f = gt.nn.LayerNorm(cfg.n_embd)
        self.classifier = gt.nn.VocabParallelClassifier(
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
    """Next-token cross entropy of ``[B, S, V]`` logits (any layout: gathered, vocab-sharded,
    sequence-split) and ``[B, S]`` targets."""

    def __init__(self):
        super().__init__()
        self.ce = gt.nn.CrossEntropyLoss()

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
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
    """GPT-2's init drawn from one seeded CPU generator, tensor by tensor in state-dict order,
    so every run (and every layout, which the engine cuts from these weights) starts alike."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or t.is_meta:  # the tied classifier weight; gt.lazy_init
            continue
        seen.add(id(t))
        std = _init_std(key, cfg)
        if std is not None:
            t.copy_(torch.empty(t.shape).normal_(0.0, std, generator=gen))
        elif key.endswith(".weight"):  # LayerNorm scale
            t.fill_(1.0)
        else:
            t.zero_()


def dense_copy(model: nn.Module, cfg: GPTConfig, device: torch.device | str = "cpu") -> GPT:
    """A single-process GPT holding ``model``'s full weights (collective: call on every rank)."""
    dense = GPT(cfg)
    dense.load_state_dict(gt.full_state_dict(model))
    return dense.to(device)


@contextlib.contextmanager
def single_process():
    """Run a dense copy on one rank: ``gt.nn.attention`` and positions act as with no
    parallelism inside (they read the current context at call time)."""
    saved = get_context() if has_context() else None
    set_context(None)
    try:
        yield
    finally:
        set_context(saved)


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
    with single_process():
        idx = _sample(model, idx, max_new_tokens, block_size, temperature, top_k, generator)
    model.train(was_training)
    return idx


def _sample(model, idx, max_new_tokens, block_size, temperature, top_k, generator):
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
    return idx
