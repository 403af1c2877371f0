"""A ``ModelSpec`` by preset name or from a Hugging Face ``config.json`` (GPT-2, Llama,
Mistral, Mixtral, Qwen2, Gemma, OPT, GPT-NeoX, Falcon and anything with the usual key names).

Every value is checked before a number is computed (``models.check_fields``); an error
names the file and the ``config.json`` key, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gridtrain.estimate.models import PRESETS, ModelError, ModelSpec, check_fields

KEYS = {  # ModelSpec field: the config.json keys that give it, first found wins
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
    "experts": ("num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok",),
}
REQUIRED = ("hidden", "layers", "heads", "vocab")
DEFAULTS = {"seq_len": 2048, "experts": 0, "top_k": 1}


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
        values = {**dataclasses.asdict(spec), "seq_len": seq_len}
        check_fields(values, spec.name, {"seq_len": "--seq-len"})
        spec = dataclasses.replace(spec, seq_len=seq_len)
    return spec


def _read(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"cannot read {path}: {err}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: a config.json holds one JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:  # multimodal
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _sizes(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The sizes of ``cfg`` by field, and the key each came from (for error messages)."""
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    for field, keys in KEYS.items():
        key = next((k for k in keys if cfg.get(k) is not None), None)
        if key is None:
            if field in REQUIRED:
                raise ModelError(f"{path}: no {field} (looked for {', '.join(keys)})")
            values[field] = DEFAULTS.get(field)
            names[field] = keys[0]
            continue
        values[field], names[field] = cfg[key], key
    return values, names


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` of a decoder-only model."""
    path = Path(path)
    cfg = _read(path)
    values, names = _sizes(cfg, path)
    kind = str(cfg.get("model_type", "")).lower()
    learned = kind in ("gpt2", "opt", "gpt_bigcode")
    values["positions"] = values["seq_len"] if learned else 0
    names["positions"] = names["seq_len"]
    check_fields(values, str(path), names)
    act = str(_first(cfg, "hidden_act", "activation_function", default="gelu")).lower()
    gated = act in ("silu", "swiglu", "swish") or kind in ("llama", "mistral", "qwen2", "gemma")
    rms = "rms_norm_eps" in cfg or kind in ("llama", "mistral", "qwen2", "gemma", "t5")
    return ModelSpec(
        name=str(_first(cfg, "_name_or_path", default=path.parent.name or path.name)),
        **values,
        gated=gated,
        norm="rms" if rms else "layer",
        bias=bool(_first(cfg, "attention_bias", "bias", default=not rms)),
        tied=bool(cfg.get("tie_word_embeddings", kind in ("gpt2", "opt"))),
        dropout=0.0,
    )


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default
