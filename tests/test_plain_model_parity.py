"""A model nobody wrote for gridtrain (plain ``torch.nn`` layers) trains under every layout from
the config alone, with the losses, gradients and weights of the same model in one process,
while each rank holds only its share of the parameters."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout, tensor_of
from helpers.models import TinyTransformer
from helpers.runs import (
    assert_grads_close,
    data_rows,
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    token_batches,
)

import gridtrain as gt

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 64
PLAN_1D = {  # the Megatron pairs, given explicitly (HF tp_plan patterns)
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.fc": "colwise",
    "blocks.*.fc2": "rowwise",
    "head": "vocab_parallel",
}
# name: (world, config, model kwargs, expected share of a sharded 2-D weight)
LAYOUTS = {
    "1d2-plan": (2, dict(parallel=dict(tensor=dict(tensor_of("1d2"), plan=PLAN_1D))), {}, 1 / 2),
    "1d2-traced": (*layout("1d2"), {}, 1 / 2),
    "1d2-traced-tied": (*layout("1d2"), {"tie": True}, 1 / 2),
    "dp2-1d2": (*layout("dp2-1d2"), {}, 1 / 2),
    "2d4-tied": (*layout("2d4"), {"tie": True}, 1 / 4),
    "2.5d8-depth2": (*layout("2.5d8"), {}, 1 / 4),
    "3d8-tied": (*layout("3d8"), {"tie": True}, 1 / 8),
    "pp2": (*layout("pp2", num_microbatches=4), {}, 1.0),
    "dp2-1d2-pp2": (*layout("dp2-1d2-pp2", num_microbatches=2), {}, 1 / 2),
}


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _model(model_kw):
    return seeded(lambda: TinyTransformer(vocab=VOCAB, seq=SEQ, **model_kw), seed=0)


def _train(ctx, batches, model_kw):
    x0 = data_rows(batches[0][0], ctx)  # this rank's rows: traced for shapes only
    build = lambda: _model(model_kw)  # noqa: E731
    return engine_run(ctx, build, batches, lm_loss, _adamw, example_inputs=x0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plain_transformer_equals_one_process(name):
    world, config, model_kw, share = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = reference_run(
        lambda: _model(model_kw),
        batches,
        dense_lm_loss,
        _adamw,
    )
    d_final = ref.state
    results = run_distributed(_train, world, batches, model_kw, config=config, timeout=300)
    replica = world // gt.Config.from_dict(config).data_size(world)
    # a rank reports the mean over its data-parallel rank's rows: their mean is the dense loss;
    # float64 throughout: sharded matmuls and collectives only reorder sums, measured
    # <= 1e-15 relative on losses and gradients
    assert global_losses(results) == pytest.approx(ref.losses, rel=1e-12), name
    for rank, run in enumerate(results):
        tag = f"{name} rank {rank}"
        final, held, plan = run.state, run.shares, run.plan
        assert run.losses == results[rank - rank % replica].losses, "one loss per model replica"
        assert set(final) == set(d_final), "full state dict has the plain model's keys"
        # every parameter's first-step gradient, as the optimizer stepped with it
        assert_grads_close(run.grads[0], ref, msg=tag, rtol=1e-10, atol=1e-12)
        for k, v in d_final.items():
            # AdamW divides by sqrt(v) + 1e-8: on near-zero gradients a 1e-16 difference can
            # move a weight by lr * 1e-16 / 1e-8 = 1e-10 per step; a wrong shard is O(lr)
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=f"{tag} {k}")
        # really cut: every block weight holds its share only (a replica would hold 1.0);
        # under a pipeline each stage holds only its own blocks
        for k in ("blocks.0.fc.weight", "blocks.1.attn.out.weight"):
            if k in held:
                assert held[k] == pytest.approx(share), (tag, held)
        stage = ctx_stage(rank, world, config)
        assert ("blocks.0.fc.weight" in held) == (stage == 0), (tag, sorted(held))
        if "tensor" in config["parallel"]:  # the printed plan names every layer it cut
            assert "blocks.1.fc2" in plan and ("rowwise" in plan or "auto" in plan), plan


def ctx_stage(rank: int, world: int, config: dict) -> int:
    """The pipeline stage of ``rank`` (tensor innermost, then pipeline, then data)."""
    par = config["parallel"]
    p, t = par.get("pipeline", 1), par.get("tensor", {}).get("size", 1)
    return (rank // t) % p
