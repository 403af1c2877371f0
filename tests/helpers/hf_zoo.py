"""Every decoder-only causal LM family of the installed ``transformers``, built tiny.

``families()`` walks ``transformers``' own list of causal LMs
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) and keeps each class once, built from its config
class with ``TINY``'s sizes (2 layers, hidden 64, 4 heads, 2 key/value heads, vocabulary
128) plus the few changes a family needs to build small (``CONFIG``, data). A family is
left out, with its reason (``skipped()``), only when it is not a decoder-only text model
(multimodal, the decoder of an encoder-decoder, an encoder) or cannot be built and run from
a tiny config on the CPU; the reasons are found by building it, not listed by hand, except
``NOT_TEXT`` (what the class name cannot tell).
"""

from __future__ import annotations

import logging
import warnings

import torch

VOCAB = 64
# the sizes every family gets where its config has the field (attribute_map aliases included)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_routed_experts=4,
    n_shared_experts=1,
    shared_expert_intermediate_size=16,
)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# model type -> config changes beyond TINY that it needs to build small and run (data)
CONFIG: dict[str, dict] = {
    "falcon": dict(head_dim=None, new_decoder_architecture=True, num_kv_heads=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=8),
    "gptj": dict(rotary_dim=4),
    "codegen": dict(rotary_dim=4),
    "ctrl": dict(dff=64),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "xglm": dict(ffn_dim=64),
    "rembert": dict(input_embedding_size=32, output_embedding_size=32),
    # its full-attention layers' own head_dim (512) would make one layer 0.91 of the model
    "gemma4_unified_text": dict(global_head_dim=8),
}
# model types whose class name does not say they are no text model
NOT_TEXT = {
    "musicgen": "audio codebooks (a music decoder)",
    "musicgen_melody": "audio codebooks (a music decoder)",
    "whisper": "the decoder of a speech model",
    "trocr": "the decoder of an OCR model",
    "moshi": "audio (speech-text) model",
}
MAX_PARAMS = 300_000  # a config that does not shrink below this is not tiny
SEQ = 8


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (``TINY`` and ``CONFIG``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    known = set(getattr(cls, "attribute_map", {})) | set(vars(default))
    kw = {k: v for k, v in TINY.items() if k in known or hasattr(default, k)}
    for key, value in vars(default).items():  # no dropout: runs compare draw for draw
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            kw[key] = 0.0
    for key in TOKEN_IDS:  # a family's own ids may lie beyond the tiny vocabulary
        value = getattr(default, key, None)
        if isinstance(value, int) and value >= VOCAB:
            kw[key] = 1 if key == "pad_token_id" else 0
    kw.update(CONFIG.get(model_type, {}))
    kw = {k: v for k, v in kw.items() if v is not None}
    return cls(**kw)


def model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The seeded tiny model of ``model_type`` (the same weights in every process)."""
    cfg = tiny_config(model_type)
    cfg._attn_implementation = "sdpa" if model_class(model_type)._supports_sdpa else "eager"
    with _quiet():
        torch.manual_seed(seed)
        model = model_class(model_type)(cfg)
    return model.to(dtype)


def _quiet():
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return stack


def dtype_of(model_type: str) -> torch.dtype:
    """float64, or float32 for a family whose kernels take no float64 (MoE grouped matmuls)."""
    return torch.float64 if _runs(model_type, torch.float64) is None else torch.float32


def canonical(model_types: list[str], arch: str) -> str:
    """Of the model types sharing class ``arch``, the one it is named after (else the first)."""
    stem = arch.removesuffix("ForCausalLM").removesuffix("LMHeadModel").lower()
    same = [m for m in model_types if m.replace("_", "").replace("-", "") == stem]
    return same[0] if same else model_types[0]


def survey() -> tuple[dict[str, torch.dtype], dict[str, str]]:
    """(model type -> the dtype it trains in, model type -> why it is skipped), over every
    causal LM class of the installed ``transformers``, by building each (minutes: run it by
    hand to refresh ``test_hf_sweep.SKIPPED`` after a ``transformers`` upgrade)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kept: dict[str, torch.dtype] = {}
    skipped: dict[str, str] = {}
    by_class: dict[str, list[str]] = {}
    for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        by_class.setdefault(arch, []).append(model_type)
    for arch, model_types in by_class.items():
        first = canonical(model_types, arch)
        order = [first] + [m for m in model_types if m != first]
        swept = None
        for model_type in order:  # the class once: by the first of its types that builds
            if swept is not None:
                skipped[model_type] = f"the same class as {swept} ({arch})"
                continue
            why, dtype = _probe(model_type, arch)
            if why is None:
                kept[swept := model_type] = dtype
            else:
                skipped[model_type] = why
    return kept, skipped


def _probe(model_type: str, arch: str) -> tuple[str | None, torch.dtype]:
    """(None or why ``model_type`` is left out, the dtype it runs in)."""
    if not arch.endswith(("ForCausalLM", "LMHeadModel")):
        return f"not a text-only causal LM ({arch})", torch.float64
    if model_type in NOT_TEXT:
        return NOT_TEXT[model_type], torch.float64
    try:
        cfg = tiny_config(model_type)
    except Exception as err:  # noqa: BLE001 - the reason it is skipped
        return f"no tiny config ({_first_line(err)})", torch.float64
    if getattr(cfg, "is_encoder_decoder", False):
        return "the decoder of an encoder-decoder model", torch.float64
    try:
        with _quiet(), torch.device("meta"):
            meta = model_class(model_type)(cfg)
    except Exception as err:  # noqa: BLE001
        return f"does not build from a tiny config ({_first_line(err)})", torch.float64
    numel = sum(p.numel() for p in meta.parameters())
    if numel > MAX_PARAMS:
        return f"does not shrink ({numel:,} parameters from the tiny config)", torch.float64
    if any("crossattention" in n or "encoder_attn" in n for n, _ in meta.named_modules()):
        return "the decoder of an encoder-decoder model (cross-attention)", torch.float64
    for dtype in (torch.float64, torch.float32):
        why = _runs(model_type, dtype)
        if why is None:
            return None, dtype
    return why, torch.float64


def _runs(model_type: str, dtype: torch.dtype) -> str | None:
    """None when the tiny model trains one step in ``dtype`` and is causal, else why not."""
    try:
        model = build(model_type, dtype).eval()  # no dropout: the causality check compares
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with _quiet():
            logits = model(input_ids=ids).logits
            logits.sum().backward()
            changed = ids.clone()
            changed[:, -1] = (changed[:, -1] + 1) % VOCAB
            later = model(input_ids=changed).logits
    except Exception as err:  # noqa: BLE001
        return f"does not run from a tiny config on the CPU ({_first_line(err)})"
    if not torch.allclose(logits[:, :-1], later[:, :-1], rtol=1e-4, atol=1e-5):
        return "not causal (an encoder: earlier positions see the last token)"
    return None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:120] if text else ''}"
