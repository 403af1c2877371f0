"""Every decoder-only causal LM family of the installed ``transformers``, tiny, under 1d2, 2d4,
pp2 and sequence 2, from the config alone: each cell equals the same model trained in one
plain process, or is refused at ``gt.initialize`` with a ``gt.PlanError`` naming what it
lacks. Never a silent mismatch, never another error.

The families are ``transformers``' own list (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), each
class once, built tiny by ``helpers.hf_zoo``; ``SKIPPED`` lists those left out and why (found
by building each one: ``hf_zoo.survey()``), and a family the list does not know is swept.
``EXPECTED`` is the table: "=" for equal, else words of the refusal. One distributed call per
layout runs every family in turn (``gt.initialize`` many times in one launch); float64, or
float32 where the family's MoE kernels take no float64 (``hf_zoo``).

Equal means: the global losses of both steps, every parameter's first-step gradient (read
off SGD's momentum) and ``gt.full_state_dict`` after training (every key of the dense
``state_dict``, tied aliases included) agree with the plain run; and each rank holds at most
``HELD[layout]`` of the dense parameters where the layout shards them.
"""

from __future__ import annotations

import functools
import time
import traceback
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_zoo
from helpers.harness import run_distributed
from helpers.runs import (
    data_rows,
    engine_step,
    global_losses,
    local_numel,
    reference_run,
    start_engine,
    stepped_grads,
    token_batches,
)

import gridtrain as gt

STEPS, BATCH, SEQ = 2, 4, 8
LAYOUTS = {
    "1d2": (2, dict(parallel=dict(tensor=dict(size=2, mode="1d")))),
    "2d4": (4, dict(parallel=dict(tensor=dict(size=4, mode="2d")))),
    "pp2": (2, dict(parallel=dict(pipeline=2), num_microbatches=2)),
    "seq2": (2, dict(parallel=dict(tensor=dict(size=2, mode="sequence")))),
}
# the most of the dense parameters one rank may hold where the layout shards them (2-layer
# models: embeddings and heads are a large part; a replica holds 1.0)
HELD = {"1d2": 0.8, "2d4": 0.6, "pp2": 0.85}
# float64: layouts differ from one process only by summation order; float32 (and norms that
# round to float32 inside, in both runs alike) leaves ~1e-6. A dropped soft cap, multiplier or
# stale weight moves a loss by percent and a weight by a whole SGD step (lr 0.1 x gradient).
TOL = {torch.float64: dict(rtol=1e-6, atol=1e-8), torch.float32: dict(rtol=2e-4, atol=2e-5)}

# model type -> why it is not swept (hf_zoo.survey() on transformers 5.24)
SKIPPED = {
    "axk1": "does not shrink (3,598,144 parameters from the tiny config)",
    "axk2": "does not shrink (2,770,208 parameters from the tiny config)",
    "bailing_hybrid": "does not run from a tiny config on the CPU (ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain LinearAttention laye)",
    "bamba": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
    "bart": "the decoder of an encoder-decoder model",
    "bert": "not causal (an encoder: earlier positions see the last token)",
    "bert-generation": "not a text-only causal LM (BertGenerationDecoder)",
    "big_bird": "not causal (an encoder: earlier positions see the last token)",
    "bigbird_pegasus": "the decoder of an encoder-decoder model",
    "blenderbot": "the decoder of an encoder-decoder model",
    "blenderbot-small": "the decoder of an encoder-decoder model",
    "blt": "does not shrink (4,632,926,976 parameters from the tiny config)",
    "camembert": "not causal (an encoder: earlier positions see the last token)",
    "cohere_compass_text": "does not build from a tiny config (KeyError: 'full_attention')",
    "cpmant": "does not shrink (2,141,344 parameters from the tiny config)",
    "data2vec-text": "not causal (an encoder: earlier positions see the last token)",
    "dbrx": "does not build from a tiny config (AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta')",
    "deepseek_v2": "does not shrink (3,599,776 parameters from the tiny config)",
    "deepseek_v3": "does not shrink (3,596,448 parameters from the tiny config)",
    "deepseek_v32": "does not shrink (28,775,072 parameters from the tiny config)",
    "deepseek_v4": "does not shrink (805,433 parameters from the tiny config)",
    "dots3_note": "does not build from a tiny config (AttributeError: 'Dots3NoteConfig' object has no attribute 'pad_token_id')",
    "dots3_note_text": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
    "electra": "not causal (an encoder: earlier positions see the last token)",
    "emu3": "does not build from a tiny config (AttributeError: 'Emu3Config' object has no attribute 'pad_token_id')",
    "ernie": "not causal (an encoder: earlier positions see the last token)",
    "exaone": "the same class as llama (LlamaForCausalLM)",
    "fuyu": "does not shrink (9,408,238,592 parameters from the tiny config)",
    "gemma3": "not a text-only causal LM (Gemma3ForConditionalGeneration)",
    "gemma3n": "not a text-only causal LM (Gemma3nForConditionalGeneration)",
    "gemma3n_text": "does not build from a tiny config (ValueError: The set of layer types producing a cache is different than the set of layer types using them)",
    "gemma4": "not a text-only causal LM (Gemma4ForConditionalGeneration)",
    "gemma4_assistant": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
    "gemma4_text": "does not shrink (134,482,544 parameters from the tiny config)",
    "gemma4_unified": "not a text-only causal LM (Gemma4UnifiedForConditionalGeneration)",
    "gemma4_unified_assistant": "does not shrink (2,872,140,800 parameters from the tiny config)",
    "git": "does not shrink (85,846,432 parameters from the tiny config)",
    "glm4_moe_lite": "does not shrink (3,232,544 parameters from the tiny config)",
    "glm_moe_dsa": "does not shrink (23,072,416 parameters from the tiny config)",
    "got_ocr2": "not a text-only causal LM (GotOcr2ForConditionalGeneration)",
    "gpt-sw3": "the same class as gpt2 (GPT2LMHeadModel)",
    "granitemoehybrid": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
    "hy_v4": "does not shrink (11,575,125 parameters from the tiny config)",
    "inkling2_loop_text": "does not shrink (7,258,752 parameters from the tiny config)",
    "inkling2_text": "does not shrink (7,880,064 parameters from the tiny config)",
    "inkling_text": "does not shrink (1,446,402 parameters from the tiny config)",
    "internlm3": "the same class as llama (LlamaForCausalLM)",
    "iquestcoder": "the same class as llama (LlamaForCausalLM)",
    "jamba": "does not run from a tiny config on the CPU (ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain LinearAttention laye)",
    "kimi_linear": "does not shrink (3,289,184 parameters from the tiny config)",
    "lara_mini": "does not shrink (300,624 parameters from the tiny config)",
    "lfm2_moe": "does not build from a tiny config (TypeError: 'NoneType' object is not subscriptable)",
    "lfm3": "does not run from a tiny config on the CPU (ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain LinearAttention laye)",
    "llama4": "does not build from a tiny config (AttributeError: 'Llama4Config' object has no attribute 'pad_token_id')",
    "longcat_flash": "does not shrink (3,873,056 parameters from the tiny config)",
    "mamba2": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
    "marian": "the decoder of an encoder-decoder model",
    "mbart": "the decoder of an encoder-decoder model",
    "megatron-bert": "not causal (an encoder: earlier positions see the last token)",
    "minicpm3": "does not shrink (823,456 parameters from the tiny config)",
    "minimax_m3_vl_text": "does not shrink (649,664 parameters from the tiny config)",
    "mllama": "does not shrink (9,775,192,080 parameters from the tiny config)",
    "moshi": "audio (speech-text) model",
    "moss_transcribe_diarize": "not a text-only causal LM (MossTranscribeDiarizeForConditionalGeneration)",
    "musicgen": "audio codebooks (a music decoder)",
    "musicgen_melody": "audio codebooks (a music decoder)",
    "mvp": "the decoder of an encoder-decoder model",
    "nemotron_h": "does not shrink (1,423,520 parameters from the tiny config)",
    "pegasus": "the decoder of an encoder-decoder model",
    "phi4_multimodal": "does not shrink (869,950,240 parameters from the tiny config)",
    "plbart": "the decoder of an encoder-decoder model",
    "prophetnet": "no tiny config (NotImplementedError: This model does not support the setting of `num_hidden_layers`. Please set `num_encoder_layers` and `num_decoder_layers`)",
    "qwen3_5": "does not build from a tiny config (AttributeError: 'Qwen3_5Config' object has no attribute 'vocab_size')",
    "qwen3_5_moe": "does not build from a tiny config (AttributeError: 'Qwen3_5MoeConfig' object has no attribute 'vocab_size')",
    "qwen3_5_moe_text": "does not shrink (1,138,528 parameters from the tiny config)",
    "qwen3_5_text": "does not shrink (1,135,136 parameters from the tiny config)",
    "qwen3_next": "does not shrink (1,138,528 parameters from the tiny config)",
    "qwen4_exp": "does not build from a tiny config (AttributeError: 'Qwen4ExpConfig' object has no attribute 'vocab_size')",
    "qwen4_exp_text": "does not shrink (1,550,656 parameters from the tiny config)",
    "recurrent_gemma": "does not run from a tiny config on the CPU (ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain LinearAttention laye)",
    "reformer": "not a text-only causal LM (ReformerModelWithLMHead)",
    "rembert": "not causal (an encoder: earlier positions see the last token)",
    "roberta": "not causal (an encoder: earlier positions see the last token)",
    "roberta-prelayernorm": "not causal (an encoder: earlier positions see the last token)",
    "roc_bert": "does not shrink (13,489,664 parameters from the tiny config)",
    "roformer": "not causal (an encoder: earlier positions see the last token)",
    "rwkv": "does not run from a tiny config on the CPU (RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [2, 3)",
    "sarvam_mla": "does not shrink (1,186,592 parameters from the tiny config)",
    "sarvam_moe": "the same class as glm4_moe (Glm4MoeForCausalLM)",
    "trocr": "the decoder of an OCR model",
    "whisper": "the decoder of a speech model",
    "xlm": "not causal (an encoder: earlier positions see the last token)",
    "xlm-roberta": "not causal (an encoder: earlier positions see the last token)",
    "xlm-roberta-xl": "not causal (an encoder: earlier positions see the last token)",
    "xlnet": "no tiny config (NotImplementedError: The model xlnet is one of the few models that has no sequence length limit.)",
    "xlstm": "does not run from a tiny config on the CPU (ValueError: matC_old has wrong shape, got torch.Size([2, 8, 8, 8]))",
    "xmod": "does not run from a tiny config on the CPU (ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()`)",
    "youtu": "does not shrink (3,594,400 parameters from the tiny config)",
    "zamba": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_layer_type':)",
    "zamba2": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_layer_type':)",
    "zaya": "no tiny config (StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':)",
}
# family -> {layout: "=" or words of its refusal}; a family missing here must equal everywhere
EXPECTED: dict[str, dict[str, str]] = {}


def families() -> list[str]:
    """The swept model types: every causal LM class of ``transformers`` but ``SKIPPED``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [m for m in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if m not in SKIPPED]


def lm_loss(out, labels):
    return gt.nn.CrossEntropyLoss()(out.logits.reshape(-1, hf_zoo.VOCAB), labels.reshape(-1))


def dense_loss(out, labels):
    return F.cross_entropy(out.logits.reshape(-1, hf_zoo.VOCAB), labels.reshape(-1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches() -> list:
    return [(dict(input_ids=x), y) for x, y in token_batches(STEPS, BATCH, SEQ, hf_zoo.VOCAB)]


@cache
def reference() -> dict[str, tuple[torch.dtype, object]]:
    """Family -> (its dtype, its plain run)."""
    out = {}
    for name in families():
        dtype = hf_zoo.dtype_of(name)
        build = functools.partial(hf_zoo.build, name, dtype)
        out[name] = dtype, reference_run(build, batches(), dense_loss, sgd)
    return out


def _cell(ctx, name: str, dtype, data) -> dict:
    """One family under this launch's layout, on this rank."""
    model = hf_zoo.build(name, dtype)
    dense = sum(p.numel() for p in model.parameters())
    try:
        engine, _ = start_engine(model, lm_loss, sgd)
    except gt.PlanError as err:
        return dict(refused=str(err))
    losses, grads = [], None
    for step, batch in enumerate(data):
        losses.append(engine_step(engine, *data_rows(batch, ctx), ctx))
        if step == 0:
            grads = stepped_grads(
                None, gt.full_optimizer_state_dict(engine.model, engine.optimizer)
            )
    held = sum(local_numel(p) for p in engine.model.parameters()) / dense
    state = gt.full_state_dict(engine.model)
    first = ctx.global_rank == 0  # dense values are alike on every rank: ship one
    return dict(
        losses=losses,
        held=held,
        plan=str(engine.plan) if first else None,
        grads=grads if first else None,
        state=state if first else None,
    )


def _sweep(ctx, names: list[tuple[str, torch.dtype]], data) -> dict:
    out = {}
    for name, dtype in names:
        start = time.perf_counter()
        try:
            out[name] = _cell(ctx, name, dtype, data)
        except Exception:  # noqa: BLE001 - reported per cell
            out[name] = dict(error=traceback.format_exc())
        out[name]["seconds"] = time.perf_counter() - start
    return out


@cache
def layout(name: str) -> dict[str, list[dict]]:
    """Family -> every rank's cell, for one layout (one distributed call)."""
    world, config = LAYOUTS[name]
    names = [(n, dtype) for n, (dtype, _) in reference().items()]
    ranks = run_distributed(_sweep, world, names, batches(), config=config, timeout=900)
    return {family: [r[family] for r in ranks] for family, _ in names}


def verdict(family: str, layout_name: str) -> str:
    """'=' when the cell equals one process (asserted), else the refusal's message."""
    dtype, ref = reference()[family]
    cells = layout(layout_name)[family]
    errors = [c["error"] for c in cells if "error" in c]
    assert not errors, f"{family} under {layout_name} failed:\n{errors[0]}"
    refused = {c.get("refused") for c in cells}
    if refused != {None}:
        assert None not in refused, f"{family} under {layout_name}: refused on some ranks only"
        return refused.pop()
    tol, tag = TOL[dtype], f"{family} {layout_name}"
    torch.testing.assert_close(global_losses([c["losses"] for c in cells]), ref.losses, **tol)
    rank0 = cells[0]
    assert set(rank0["state"]) == set(ref.state), f"{tag}: state dict keys differ"
    for key, value in ref.state.items():
        torch.testing.assert_close(rank0["state"][key], value, **tol, msg=_msg(f"{tag} {key}"))
    for key, g in ref.grads[0].items():
        torch.testing.assert_close(rank0["grads"][key], g, **tol, msg=_msg(f"{tag} grad {key}"))
    bound = HELD.get(layout_name)
    if bound is not None:
        held = max(c["held"] for c in cells)
        assert held <= bound, f"{tag}: a rank holds {held:.2f} of the model"
    return "="


def _msg(tag: str):
    return lambda detail: f"{tag}: {detail}"


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_family(layout_name):
    got = {family: verdict_or_failure(family, layout_name) for family in families()}
    failed = {f: v for f, v in got.items() if v.startswith("FAILED")}
    print(f"\nSWEEP {layout_name}: " + ", ".join(f"{f} {v[:60]!r}" for f, v in got.items()))
    assert not failed, "\n".join(f"{f}: {v}" for f, v in failed.items())


def verdict_or_failure(family: str, layout_name: str) -> str:
    try:
        return verdict(family, layout_name)
    except AssertionError as err:
        return f"FAILED {err}"
