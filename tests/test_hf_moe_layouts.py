"""Expert parallelism of Hugging Face MoE models composes with the other layouts: data
parallelism beyond the expert group, 1d tensor parallelism of attention and the dense layers,
sequence parallelism, pipeline parallelism, ZeRO 1/2/3 and activation checkpointing, each
equal to the same model trained in one process (``test_hf_moe_parity.check_parity``: losses,
every step's gradients, the weights after 3 AdamW steps, each rank holding only its experts).
"""

from __future__ import annotations

import pytest
from test_hf_moe_parity import check_parity


def _cfg(ep=2, tensor=None, pipeline=1, **extra):
    cfg = dict(moe=dict(expert_parallel_size=ep), **extra)
    if tensor is not None or pipeline > 1:
        cfg["parallel"] = dict(pipeline=pipeline, **({"tensor": tensor} if tensor else {}))
    return cfg


# name: (family, world, config, model config overrides)
LAYOUTS = {
    # data 4, experts over pairs: EXPERT_DATA of 2 ranks averages each expert's gradient
    "dp4-ep2": ("mixtral", 4, _cfg(), {}),
    # 1d: attention, shared expert and head split over TENSOR, experts over EXPERT
    "1d2-ep2": ("qwen2_moe", 4, _cfg(tensor=dict(size=2, mode="1d")), {}),
    # sequence: ring attention; each sequence rank dispatches its own tokens
    "seq2-ep2": ("qwen3_moe", 4, _cfg(tensor=dict(size=2, mode="sequence")), {}),
    # pipeline: each stage's experts over its own EXPERT group (no router logits across stages)
    "pp2-ep2": (
        "deepseek_v3",
        4,
        _cfg(pipeline=2, num_microbatches=2),
        dict(output_router_logits=False),
    ),
    "ep2-zero1": ("mixtral", 2, _cfg(zero=dict(stage=1)), {}),
    "ep2-zero2": ("mixtral", 2, _cfg(zero=dict(stage=2)), {}),
    "ep2-zero3-checkpointed": (
        "qwen2_moe",
        2,
        _cfg(zero=dict(stage=3), activation_checkpoint=True),
        {},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_composes(layout):
    family, world, config, model_kw = LAYOUTS[layout]
    check_parity(family, world, config, ep=2, **model_kw)
