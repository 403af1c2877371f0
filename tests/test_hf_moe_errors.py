"""What gridtrain cannot do with a Hugging Face mixture-of-experts model is refused at
``gt.initialize``, naming the module and what it lacks, before any weight moves:

* a family whose experts are not fused ``[num_experts, ...]`` tensors named by an
  expert-parallel plan (JetMoE's ``JetMoeParallelExperts``) under ``expert_parallel_size`` 2;
* the router logits under pipeline parallelism (each stage sees only its own layers');
* experts that do not divide over the expert group.
"""

from __future__ import annotations

import pytest
from helpers.harness import run_distributed
from helpers.hf_moe import adamw, moe_loss, tiny_moe

import gridtrain as gt


def _jetmoe():
    import transformers as tf

    cfg = tf.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(cfg)


def _initialize_error(ctx, family: str, model_kw: dict):
    model = _jetmoe() if family == "jetmoe" else tiny_moe(family, **model_kw)
    try:
        gt.initialize(model, adamw(model), moe_loss(0.1))
    except ValueError as err:  # PlanError is a ValueError
        return type(err).__name__, str(err)
    return None, None


CASES = {
    "no expert plan": (
        "jetmoe",
        {},
        2,
        dict(moe=dict(expert_parallel_size=2)),
        ["'model.layers.0.mlp' (JetMoeMoE)", "JetMoeForCausalLM", "expert-parallel plan"],
    ),
    "router logits under a pipeline": (
        "mixtral",
        {},
        2,
        dict(parallel=dict(pipeline=2), num_microbatches=2),
        ["MixtralForCausalLM", "output_router_logits", "pipeline"],
    ),
    "a router style gridtrain does not implement": (
        "mixtral",
        {"ep_styles": {"model.layers.*.mlp.gate": "local_router"}},
        2,
        dict(moe=dict(expert_parallel_size=2)),
        ["'model.layers.*.mlp.gate'", "'local_router'", "ep_router", "moe_tp_experts"],
    ),
    "experts do not divide": (
        "qwen3_moe",
        {},
        3,
        dict(moe=dict(expert_parallel_size=3)),
        ["'model.layers.0.mlp.experts'", "4 experts", "moe.expert_parallel_size 3"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_initialize_naming_the_module(case):
    family, model_kw, world, config, words = CASES[case]
    for kind, message in run_distributed(_initialize_error, world, family, model_kw, config=config):
        assert kind == "PlanError", message
        for word in words:
            assert word in message, message
