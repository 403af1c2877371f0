"""What is estimated: a decoder-only transformer's shape, from a preset or a Hugging Face config.

``ModelSpec`` holds the numbers every formula needs (layers, hidden size, heads,
key/value heads, MLP width, vocabulary, sequence length, norm and MLP kind, ties).
Presets cover GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1)
and Llama / Llama 2 (Touvron et al. 2023); ``from_hf_config`` reads a Hugging
Face ``config.json`` (GPT-2, Llama, Mistral, Qwen2, Gemma, OPT, GPT-NeoX, Falcon
and anything with the usual key names). Vocabularies are padded the way
Megatron-LM and nanoGPT pad them (GPT-2's 50257 -> 50304), so that they split
over tensor groups; a Hugging Face vocabulary is kept as given.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A model name or config.json that cannot be estimated (names the file and the key)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (pre-norm blocks: attention then MLP)."""

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

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ModelError(
                f"{self.name}: hidden {self.hidden} is not divisible by heads {self.heads}"
            )
        if self.heads % self.num_kv_heads:
            raise ModelError(
                f"{self.name}: heads {self.heads} are not divisible by key/value heads "
                f"{self.num_kv_heads}"
            )
        if self.norm not in ("layer", "rms"):
            raise ModelError(f"{self.name}: norm must be 'layer' or 'rms', got {self.norm!r}")

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
    def qkv_out(self) -> int:
        """Width of the fused q/k/v projection: q for every head, k and v per kv head."""
        return (self.heads + 2 * self.num_kv_heads) * self.head_dim

    def num_params(self) -> int:
        """Dense parameter count (a tied head counted once)."""
        h, b = self.hidden, int(self.bias)
        norm = h * (2 if self.norm == "layer" else 1)
        fc_out = self.ffn_dim * (2 if self.gated else 1)
        block = h * self.qkv_out + b * self.qkv_out + h * h + b * h
        block += h * fc_out + b * fc_out + self.ffn_dim * h + b * h + 2 * norm
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.positions * h + self.layers * block + norm + head

    def matmul_flops_per_token(self) -> float:
        """Forward FLOPs of the Linears per token (2 per multiply-add), LM head included."""
        h = self.hidden
        fc_out = self.ffn_dim * (2 if self.gated else 1)
        per_layer = 2 * h * (self.qkv_out + h + fc_out) + 2 * self.ffn_dim * h
        return self.layers * per_layer + 2 * h * self.vocab

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of the score and value products per token (QK^T and PV)."""
        full = 4 * self.layers * self.hidden * seq_len
        return full / 2 if causal else full

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's convention (Chowdhery et al. 2022, App. B):
        6 N (N without position tables) plus 12 L H S for attention, no recompute."""
        n = self.num_params() - self.positions * self.hidden
        return 6 * n + 12 * self.layers * self.hidden * seq_len

    def describe(self) -> str:
        kv = f", {self.num_kv_heads} kv heads" if self.num_kv_heads != self.heads else ""
        mlp = f"{'SwiGLU' if self.gated else 'GELU'} {self.ffn_dim}"
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B parameters, {self.layers} layers, "
            f"hidden {self.hidden}, {self.heads} heads{kv}, {mlp}, vocab {self.vocab}, "
            f"seq {self.seq_len}"
        )


def _gpt2(name, layers, hidden, heads):
    return ModelSpec(name, layers, hidden, heads, 50304, 1024, positions=1024, dropout=0.1)


def _gpt3(name, layers, hidden, heads):
    return ModelSpec(name, layers, hidden, heads, 51200, 2048, positions=2048)


def _llama(name, layers, hidden, heads, ffn, kv=None, seq=2048):
    return ModelSpec(
        name, layers, hidden, heads, 32000, seq, kv_heads=kv, ffn=ffn, gated=True,
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
    )
}


def megatron_gpt(layers: int, hidden: int, heads: int, seq_len: int = 2048) -> ModelSpec:
    """The GPT of Narayanan et al. 2021 (vocabulary 51200, learned positions, GELU 4h)."""
    return ModelSpec(
        f"gpt-{layers}x{hidden}", layers, hidden, heads, 51200, seq_len, positions=seq_len
    )


def get_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, or a Hugging Face ``config.json`` (or a directory holding one)."""
    spec = PRESETS.get(name_or_path.lower())
    if spec is None:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelError(
                f"unknown model {name_or_path!r}: give a preset ({', '.join(PRESETS)}) or the "
                "path of a Hugging Face config.json"
            )
        spec = from_hf_config(path)
    if seq_len is not None:
        spec = dataclasses.replace(spec, seq_len=seq_len)
    return spec


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` of a decoder-only model."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelError(f"cannot read {path}: {err}") from None
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers
        cfg = {**cfg, **cfg["text_config"]}
    need = {
        "hidden": ("hidden_size", "n_embd", "d_model"),
        "layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "heads": ("num_attention_heads", "n_head"),
        "vocab": ("vocab_size",),
    }
    found = {}
    for field, keys in need.items():
        value = _first(cfg, *keys)
        if not isinstance(value, int):
            raise ModelError(f"{path}: no {field} (looked for {', '.join(keys)})")
        found[field] = value
    kind = str(cfg.get("model_type", "")).lower()
    act = str(_first(cfg, "hidden_act", "activation_function", default="gelu")).lower()
    gated = act in ("silu", "swiglu", "swish") or kind in ("llama", "mistral", "qwen2", "gemma")
    learned = kind in ("gpt2", "opt", "gpt_bigcode")
    seq = _first(cfg, "max_position_embeddings", "n_positions", "n_ctx", "seq_length", default=2048)
    rms = "rms_norm_eps" in cfg or kind in ("llama", "mistral", "qwen2", "gemma", "t5")
    bias = bool(_first(cfg, "attention_bias", "bias", default=not rms))
    return ModelSpec(
        name=str(_first(cfg, "_name_or_path", default=path.parent.name or path.name)),
        layers=found["layers"],
        hidden=found["hidden"],
        heads=found["heads"],
        vocab=found["vocab"],
        seq_len=int(seq),
        kv_heads=_first(cfg, "num_key_value_heads", "num_kv_heads"),
        ffn=_first(cfg, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
        gated=gated,
        norm="rms" if rms else "layer",
        bias=bias,
        tied=bool(cfg.get("tie_word_embeddings", kind in ("gpt2", "opt"))),
        positions=int(seq) if learned else 0,
        dropout=0.0,
    )
