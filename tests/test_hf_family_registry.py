"""Hugging Face families are a registry (``gridtrain.hf.register_family``): a family registered
from the user's code is what ``gt.initialize`` plans the model by, and a registered family is
replaced only when asked to (README, "Adding or overriding a family")."""

from __future__ import annotations

import pytest
from helpers.harness import run_distributed
from helpers.runs import local_numel
from test_hf_parity import adamw, lm_loss, tiny_model

import gridtrain as gt
from gridtrain.hf import Family, register_family
from gridtrain.hf.families import family_of, unregister_family


def _mlp_whole(model, ctx) -> dict[str, str]:
    """Llama's own plan with its MLP kept whole on every rank (README's example)."""
    plan = dict(model._tp_plan)
    plan.update({pattern: "replicate" for pattern in plan if ".mlp." in pattern})
    return plan


def test_a_registered_family_is_replaced_only_when_asked():
    model = tiny_model("gpt2")
    built_in = family_of(model)
    assert built_in.tensor_plan is not None  # GPT-2 has no _tp_plan: gridtrain's own
    mine = Family("gpt2", tensor_plan=_mlp_whole, note="mine")
    with pytest.raises(ValueError, match=r"family 'gpt2' is already registered.*replace=True"):
        register_family(mine)
    try:
        register_family(mine, replace=True)
        assert family_of(model) is mine
    finally:
        register_family(built_in, replace=True)
    assert family_of(model) is built_in
    assert family_of(tiny_model("llama")) == Family("llama")  # none: the model's own plans


def _planned_by_family(ctx):
    register_family(Family("llama", tensor_plan=_mlp_whole))
    try:
        model = tiny_model("llama")
        dense = {n: p.numel() for n, p in model.named_parameters()}
        engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    finally:
        unregister_family("llama")
    styles = {n: (e.style, e.origin) for n, e in engine.plan.entries.items() if "layers.0" in n}
    held = {
        n: local_numel(p) / dense[n]
        for n, p in engine.model.named_parameters()
        if "layers.0" in n and n.endswith("proj.weight")
    }
    return styles, held


def test_gt_initialize_plans_by_the_registered_family():
    """Under 1d (2 ranks) Llama's MLP is kept whole as the registered family says, its
    attention split by Llama's own plan, which the family's plan starts from."""
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    for styles, held in run_distributed(_planned_by_family, 2, config=config):
        p = "model.layers.0"
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert styles[f"{p}.mlp.{name}"] == ("replicate", "model plan"), styles
            assert held[f"{p}.mlp.{name}.weight"] == 1.0, held  # whole on every rank
        assert styles[f"{p}.self_attn.q_proj"] == ("colwise", "model plan"), styles
        assert held[f"{p}.self_attn.q_proj.weight"] == 0.5, held  # half the heads each
