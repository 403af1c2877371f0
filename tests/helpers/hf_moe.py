"""Tiny Hugging Face mixture-of-experts models (4 experts, top 2, hidden 32, 2 layers) and the
loss a user writes for them, shared by the ``test_hf_moe_*`` files.

Every family is built from its ``transformers`` config class (nothing downloaded), seeded,
in float32. The loss is what a user fine-tuning one writes: next-token cross entropy of
``out.logits`` plus ``coef * out.aux_loss`` (the model's load-balancing loss, asked for with
``config.output_router_logits = True``, the models' default here; DeepSeek-V3 computes none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gridtrain as gt
from helpers.runs import seeded

VOCAB, HIDDEN, EXPERTS, TOP_K = 64, 32, 4, 2
STEPS, BATCH, SEQ = 3, 8, 8
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# families checked at ep 2 only (tests/test_hf_moe_parity.py)
EP2_ONLY = ("gpt_oss",)
# dense key of one expert tensor per family (layer 0; DeepSeek's first layer is a MoE too)
EXPERT_KEY = "model.layers.0.mlp.experts.gate_up_proj"


def tiny_config(family: str, **kw):
    import transformers as tf

    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=TOP_K,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=24, num_local_experts=EXPERTS, **base)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=EXPERTS,
            norm_topk_prob=False,
            **base,
        )
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=24, num_experts=EXPERTS, head_dim=8, **base
        )
    elif family == "deepseek_v3":
        base["num_key_value_heads"] = 4  # multi-head latent attention: as many as query heads
        cfg = tf.DeepseekV3Config(
            intermediate_size=48,
            moe_intermediate_size=24,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            n_group=2,  # grouped routing: the best group of 2 experts, then the top 2 in it
            topk_group=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_mtp_layers=0,
            **base,
        )
    elif family == "gpt_oss":  # biased experts, clamped SwiGLU, attention sinks
        cfg = tf.GptOssConfig(
            intermediate_size=24, num_local_experts=EXPERTS, head_dim=8, sliding_window=4, **base
        )
    else:
        raise ValueError(family)
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def tiny_moe(family: str, dtype=torch.float32, ep_styles: dict | None = None, **kw):
    """The seeded tiny model (the same weights on every rank); ``kw`` set on its config.
    ``ep_styles``: {pattern: style} replacing entries of its expert-parallel plan (as other
    transformers releases write them)."""
    kw.setdefault("output_router_logits", True)
    import transformers as tf

    def build():
        cfg = tiny_config(family, **kw)
        attention = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS has no SDPA path
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
        with torch.no_grad():  # zero-initialised expert biases: a misplaced one shows at once
            for name, p in model.named_parameters():
                if ".experts." in name and name.endswith("_bias"):
                    p.normal_(0.0, 0.02)
        if ep_styles is not None:
            model._ep_plan = {**model._ep_plan, **ep_styles}
        return model

    return seeded(build, seed=0, dtype=dtype)


def moe_batches(steps: int = STEPS, batch: int = BATCH, seq: int = SEQ, holes: bool = True):
    """(inputs, labels) pairs: inputs ``dict(input_ids, attention_mask)``,
    labels next tokens, -100 on padding; odd rows have a padding hole (positions 2-3)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        mask = torch.ones(batch, seq, dtype=torch.long)
        if holes:
            mask[1::2, 2:4] = 0
        out.append((dict(input_ids=x, attention_mask=mask), y.masked_fill(mask == 0, -100)))
    return out


def _aux(out):
    aux = getattr(out, "aux_loss", None)
    return 0.0 if aux is None else aux


def moe_loss(coef: float):
    """What a user writes, any layout: cross entropy of the logits (through
    ``gt.nn.CrossEntropyLoss``) plus ``coef`` times the model's router loss."""

    def loss(out, labels):
        logits = out.logits
        ce = gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return ce + coef * _aux(out)

    return loss


def dense_moe_loss(coef: float):
    """The same in plain PyTorch, for the one-process reference."""

    def loss(out, labels):
        ce = F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))
        return ce + coef * _aux(out)

    return loss


def adamw(model):
    """AdamW at lr 1e-3 and eps 1e-6. Float32 leaves rounding noise on gradients, largest
    relative to elements that are ~0 in exact arithmetic (a key bias, an expert's rows
    few tokens reach), and AdamW's normalisation turns it into weight noise that grows with
    lr and 1/eps (at lr 1e-2 and eps 1e-8: weights 1e-4 apart while every gradient agreed
    to 1e-6); here it stays below 1e-5 of each tensor's scale, while a wrong or missing
    update (1e-3 per step) still shows 100 times over."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def assert_rel_close(got, want, msg: str, rel: float = 1e-5, floor: float = 1e-12) -> None:
    """``got`` equals ``want`` within ``rel`` of ``want``'s largest element (the issue's
    "1e-5 relative", on each tensor's scale: elementwise it is ill-posed where an element
    is ~0 and float32 leaves only its rounding)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rel * scale + floor, f"{msg}: max error {err:.3g} > {rel} x {scale:.3g}"


def expert_keys(model) -> list[str]:
    """Dense keys of every per-expert tensor of ``model`` (before gt.initialize)."""
    return [n for n, _ in model.named_parameters() if ".experts." in n]
