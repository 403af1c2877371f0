"""What is estimated: a decoder-only transformer's shape, from a preset or a Hugging Face config.

``ModelSpec`` holds the numbers every formula needs (layers, hidden size, heads,
key/value heads, MLP width, vocabulary, sequence length, norm and MLP kind, ties,
experts). Presets cover GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1),
Llama / Llama 2 (Touvron et al. 2023) and Llama 3 (Dubey et al. 2024, Table 3);
``model_files.from_hf_config`` reads a Hugging Face ``config.json``. Vocabularies are
padded the way Megatron-LM and nanoGPT pad them (GPT-2's 50257 -> 50304), so that they
split over tensor groups; a Hugging Face vocabulary is kept as given.

A spec is checked when it is made (``check_fields``): every size a positive integer small
enough for torch to index, every weight's element count within int64, heads dividing the
hidden size; the error names the field (the ``config.json`` key for a file).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class ModelError(ValueError):
    """A model name or config.json that cannot be estimated (names the file and the key)."""


MAX_DIM = 2**31 - 1  # torch's split/chunk counts and c10d sizes are 32-bit
MAX_NUMEL = 2**61  # elements of one weight: its bytes (x 4) must fit int64
INT_FIELDS = ("layers", "hidden", "heads", "vocab", "seq_len", "kv_heads", "ffn", "positions",
              "experts", "top_k")  # fmt: skip
MAY_BE_ZERO = ("positions", "experts")


def check_fields(values: dict[str, Any], where: str, names: dict[str, str] | None = None) -> None:
    """Raise ``ModelError`` naming the field (``names``: field -> the key it came from) when
    ``values`` cannot describe a model: a size that is not a positive integer or too large,
    heads that do not divide the width, a weight whose element count overflows int64."""
    names = names or {}

    def key(field: str) -> str:
        return names.get(field, field)

    for field in INT_FIELDS:
        v = values.get(field)
        if v is None and field in ("kv_heads", "ffn"):
            continue
        low = 0 if field in MAY_BE_ZERO else 1
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_DIM:
            raise ModelError(
                f"{where}: {key(field)} must be an integer from {low} to {MAX_DIM}, got {v!r}"
            )
    if values["hidden"] % values["heads"]:
        raise ModelError(
            f"{where}: {key('hidden')} {values['hidden']} is not divisible by "
            f"{key('heads')} {values['heads']}"
        )
    kv = values.get("kv_heads") or values["heads"]
    if values["heads"] % kv:
        raise ModelError(
            f"{where}: {key('heads')} {values['heads']} are not divisible by {key('kv_heads')} {kv}"
        )
    experts, top_k = values.get("experts", 0), values.get("top_k", 1)
    if experts and top_k > experts:
        raise ModelError(
            f"{where}: {key('top_k')} {top_k} exceeds {key('experts')} {experts} (experts per token)"
        )
    dropout = values.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ModelError(f"{where}: {key('dropout')} must be in [0, 1), got {dropout!r}")
    dims = {**values, "ffn": values.get("ffn") or 4 * values["hidden"]}
    for a, b, times in (("vocab", "hidden", 1), ("hidden", "ffn", 3 * max(1, experts)),
                        ("positions", "hidden", 1)):  # fmt: skip
        n = (dims.get(a) or 0) * dims[b] * times
        if n > MAX_NUMEL:
            raise ModelError(
                f"{where}: {key(a)} x {key(b)} makes a weight of {n:.3g} elements (more than "
                f"2**61, whose bytes int64 cannot count): a size is wrong"
            )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (pre-norm blocks: attention then an MLP or a MoE layer)."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None  # None: as many as heads (multi-head attention)
    ffn: int | None = None  # MLP width; None: 4 x hidden
    gated: bool = False  # SwiGLU (gate and up projections), as Llama
    norm: str = "layer"  # "layer" (LayerNorm, with bias) or "rms" (RMSNorm)
    bias: bool = True  # biases in the Linears
    tied: bool = True  # LM head shares the token embedding
    positions: int = 0  # rows of a learned position embedding (GPT-2); 0 = rotary
    dropout: float = 0.0
    experts: int = 0  # > 0: every block's MLP is a MoE layer of this many experts
    top_k: int = 1  # experts each token is routed to (1 or 2: gridtrain's routers)

    def __post_init__(self):
        check_fields(dataclasses.asdict(self), self.name)
        if self.norm not in ("layer", "rms"):
            raise ModelError(f"{self.name}: norm must be 'layer' or 'rms', got {self.norm!r}")
        if self.experts and self.top_k not in (1, 2):
            raise ModelError(
                f"{self.name}: top_k must be 1 or 2 (gridtrain's Top1Router, Top2Router), "
                f"got {self.top_k}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        """Width of one expert: gridtrain's ``Experts`` are two-matrix FFNs, so a gated
        expert (three matrices of ``ffn``) is held as one of ``1.5 ffn`` (as many weights)."""
        return self.ffn_dim * 3 // 2 if self.gated else self.ffn_dim

    @property
    def qkv_out(self) -> int:
        """Width of the fused q/k/v projection: q for every head, k and v per kv head."""
        return (self.heads + 2 * self.num_kv_heads) * self.head_dim

    def mlp_params(self, active: bool = False) -> int:
        """Parameters of one block's MLP (``active``: those one token uses, for FLOPs)."""
        h, b = self.hidden, int(self.bias)
        if not self.experts:
            fc_out = self.ffn_dim * (2 if self.gated else 1)
            return h * fc_out + b * fc_out + self.ffn_dim * h + b * h
        e = self.expert_ffn
        one = 2 * h * e + e + h  # w1, b1, w2, b2
        return h * self.experts + one * (self.top_k if active else self.experts)

    def num_params(self, active: bool = False) -> int:
        """Dense parameter count (a tied head counted once; ``active``: experts a token uses)."""
        h, b = self.hidden, int(self.bias)
        norm = h * (2 if self.norm == "layer" else 1)
        block = h * self.qkv_out + b * self.qkv_out + h * h + b * h
        block += self.mlp_params(active) + 2 * norm
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.positions * h + self.layers * block + norm + head

    def matmul_flops_per_token(self) -> float:
        """Forward FLOPs of the Linears per token (2 per multiply-add), LM head included."""
        h = self.hidden
        per_layer = 2 * h * (self.qkv_out + h) + 2 * self.mlp_params(active=True)
        return self.layers * per_layer + 2 * h * self.vocab

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of the score and value products per token (QK^T and PV)."""
        full = 4 * self.layers * self.hidden * seq_len
        return full / 2 if causal else full

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's convention (Chowdhery et al. 2022, App. B):
        6 N (N the active parameters, without position tables) plus 12 L H S for
        attention, no recompute."""
        n = self.num_params(active=True) - self.positions * self.hidden
        return 6 * n + 12 * self.layers * self.hidden * seq_len

    def describe(self) -> str:
        kv = f", {self.num_kv_heads} kv heads" if self.num_kv_heads != self.heads else ""
        mlp = f"{'SwiGLU' if self.gated else 'GELU'} {self.ffn_dim}"
        if self.experts:
            mlp = f"MoE {self.experts} experts (top-{self.top_k}) of {self.expert_ffn}"
            mlp += f", {self.num_params(active=True) / 1e9:.2f}B active"
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B parameters, {self.layers} layers, "
            f"hidden {self.hidden}, {self.heads} heads{kv}, {mlp}, vocab {self.vocab}, "
            f"seq {self.seq_len}"
        )


def _gpt2(name, layers, hidden, heads):
    return ModelSpec(name, layers, hidden, heads, 50304, 1024, positions=1024, dropout=0.1)


def _gpt3(name, layers, hidden, heads):
    return ModelSpec(name, layers, hidden, heads, 51200, 2048, positions=2048)


def _llama(name, layers, hidden, heads, ffn, kv=None, seq=2048, vocab=32000):
    return ModelSpec(
        name, layers, hidden, heads, vocab, seq, kv_heads=kv, ffn=ffn, gated=True,
        norm="rms", bias=False, tied=False,
    )  # fmt: skip


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _gpt2("gpt2-124m", 12, 768, 12),
        _gpt2("gpt2-350m", 24, 1024, 16),
        _gpt2("gpt2-774m", 36, 1280, 20),
        _gpt2("gpt2-1.5b", 48, 1600, 25),
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-760m", 24, 1536, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        _llama("llama-7b", 32, 4096, 32, 11008),
        _llama("llama-13b", 40, 5120, 40, 13824),
        _llama("llama-70b", 80, 8192, 64, 28672, kv=8, seq=4096),
        _llama("llama3-8b", 32, 4096, 32, 14336, kv=8, seq=8192, vocab=128256),
        _llama("llama3-70b", 80, 8192, 64, 28672, kv=8, seq=8192, vocab=128256),
    )
}


def megatron_gpt(layers: int, hidden: int, heads: int, seq_len: int = 2048) -> ModelSpec:
    """The GPT of Narayanan et al. 2021 (vocabulary 51200, learned positions, GELU 4h)."""
    return ModelSpec(
        f"gpt-{layers}x{hidden}", layers, hidden, heads, 51200, seq_len, positions=seq_len
    )
