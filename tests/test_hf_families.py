"""Hugging Face families beyond GPT-2 and Llama train under 1d, 2d, sequence and a pipeline from
the config alone, with the losses and weights of the same model in one plain process
(``check_layout``: float64, 1e-10), each rank holding only its share:

* Qwen2 with q/k/v biases and its head tied to the embedding (the tied weight on both
  pipeline stages, each stage holding at most 0.6 of the model);
* Mistral;
* Phi-3, whose fused ``qkv_proj`` and ``gate_up_proj`` are split as packed blocks (each rank
  keeps its heads of q, k and v), and with grouped key/value heads, where ``qkv_proj`` keeps
  Phi-3's own gathered split;
* Gemma: a scaled embedding and norms scaling by ``1 + weight``, both kept when gridtrain's
  layers replace them.
"""

from __future__ import annotations

import pytest
from test_hf_parity import check_layout

LAYOUTS = ["1d2", "2d4", "seq2", "pp2"]
FAMILIES = {
    # name: (model config changes, a block weight that a tensor mode cuts)
    "qwen2": (dict(tie_word_embeddings=True), "model.layers.0.self_attn.q_proj.bias"),
    "mistral": ({}, "model.layers.0.mlp.up_proj.weight"),
    "phi3": (dict(num_key_value_heads=4), "model.layers.0.self_attn.qkv_proj.weight"),
    "gemma": ({}, "model.layers.0.mlp.gate_proj.weight"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_equals_one_process(name, layout):
    model_kw, block = FAMILIES[name]
    results = check_layout(name, layout, block, together=_together(layout), **model_kw)
    if name == "phi3" and layout in ("1d2", "2d4"):  # heads split, not gathered
        for row in _rows(results[0][0].plan, "qkv_proj", "gate_up_proj").values():
            assert "packed_colwise" in row, row


def test_phi3_grouped_kv_heads_keep_the_gathered_qkv():
    """q, k and v blocks of unequal widths: qkv_proj's output is gathered, gate_up still packed."""
    block = "model.layers.0.mlp.gate_up_proj.weight"
    results = check_layout("phi3", "2d4", block, together=_together("2d4"))
    rows = _rows(results[0][0].plan, "qkv_proj", "gate_up_proj")
    assert "colwise_gather_output" in rows["qkv_proj"], rows
    assert "packed_colwise" in rows["gate_up_proj"], rows


def _together(layout: str) -> list:
    """Every model checked under ``layout``: one launch trains them all (``check_layout``)."""
    cells = [(n, kw) for n, (kw, _) in FAMILIES.items()]
    return cells + [("phi3", {})] if layout == "2d4" else cells


def _rows(plan: str, *modules: str) -> dict[str, str]:
    """The plan's row of each of ``modules`` in the first block."""
    lines = plan.splitlines()
    return {m: next(r for r in lines if "layers.0." in r and f".{m} " in r) for m in modules}
