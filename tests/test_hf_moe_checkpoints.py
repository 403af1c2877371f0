"""Checkpoints of a Hugging Face MoE model move between expert layouts with the model's own keys.

Qwen2-MoE (4 experts beside a shared expert) trains one AdamW step under
``moe.expert_parallel_size`` 4 (one expert per rank), then saves ``gt.save_checkpoint`` in
both formats (one dense file, a sharded directory) and ``gridtrain.hf.save_pretrained``.
``gt.full_state_dict`` there must hold the HF model's own dense keys and shapes, and
``transformers``' ``from_pretrained`` must read the HF directory back as those weights.
Each format is then loaded into a fresh model (other weights) under ep 2, ep 1 and
1d2 x ep2: the weights (and, from the checkpoints, AdamW's state) must be the saved ones
bit for bit, with each rank holding only its experts.
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hf_moe import adamw, expert_keys, moe_batches, moe_loss, tiny_moe
from helpers.runs import data_rows, engine_step, shares

import gridtrain as gt
import gridtrain.hf as gthf

FAMILY = "qwen2_moe"
FORMATS = ("dense", "sharded", "hf")


def _engine(perturb: bool = False):
    model = tiny_moe(FAMILY)
    dense = {n: p.numel() for n, p in model.named_parameters()}
    keys = expert_keys(model)
    if perturb:  # other weights than the saved ones: a load that does nothing shows
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine, *_ = gt.initialize(model, adamw(model), moe_loss(0.1))
    return engine, {k: v for k, v in shares(engine, dense).items() if k in keys}


def _save(ctx, root: str):
    engine, held = _engine()
    x, y = data_rows(moe_batches(1)[0], ctx)
    engine_step(engine, x, y, ctx)
    state = gt.full_state_dict(engine.model)
    optim = gt.full_optimizer_state_dict(engine.model, engine.optimizer)
    gt.save_checkpoint(f"{root}/dense.pt", 1, engine.model, engine.optimizer)
    gt.save_checkpoint(f"{root}/sharded", 1, engine.model, engine.optimizer, sharded=True)
    gthf.save_pretrained(engine.model, f"{root}/hf")
    return state, optim["state"], held


def _load(ctx, root: str):
    out = {}
    for fmt in FORMATS:
        engine, held = _engine(perturb=True)
        if fmt == "hf":
            gthf.load_pretrained(engine.model, f"{root}/hf")
            optim = None
        else:
            path = f"{root}/dense.pt" if fmt == "dense" else f"{root}/sharded"
            gt.load_checkpoint(path, engine.model, engine.optimizer)
            optim = gt.full_optimizer_state_dict(engine.model, engine.optimizer)["state"]
        out[fmt] = (gt.full_state_dict(engine.model), optim, held)
    return out


def _equal_states(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    ep4 = dict(moe=dict(expert_parallel_size=4))
    results = run_distributed(_save, 4, root, config=ep4, timeout=300)
    state, optim, _ = results[0]
    for _, _, held in results:
        assert held and all(share == 1 / 4 for share in held.values()), held
    return root, state, optim


def test_saved_under_ep4_with_the_models_own_keys(saved):
    import transformers as tf

    root, state, _ = saved
    plain = tiny_moe(FAMILY).state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in plain.items()}
    back = tf.AutoModelForCausalLM.from_pretrained(f"{root}/hf").state_dict()
    _equal_states(back, state, "from_pretrained")


@pytest.mark.parametrize(
    "world, config, ep",
    [
        (2, dict(moe=dict(expert_parallel_size=2)), 2),
        (1, dict(moe=dict(expert_parallel_size=1)), 1),
        (
            4,
            dict(
                moe=dict(expert_parallel_size=2),
                parallel=dict(tensor=dict(size=2, mode="1d")),
            ),
            2,
        ),
    ],
    ids=["ep2", "ep1", "1d2-ep2"],
)
def test_loaded_under_other_expert_layouts(saved, world, config, ep):
    root, state, optim = saved
    for rank, loaded in enumerate(run_distributed(_load, world, root, config=config)):
        for fmt, (got, got_optim, held) in loaded.items():
            assert held and all(share == 1 / ep for share in held.values()), (fmt, held)
            _equal_states(got, state, f"{fmt} on rank {rank}")
            if got_optim is not None:
                _equal_moments(got_optim, optim, f"{fmt} on rank {rank}")


def _equal_moments(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key, moments in want.items():
        for name, value in moments.items():
            same = torch.equal(torch.as_tensor(got[key][name]), torch.as_tensor(value))
            assert same, f"{what}: {key} {name}"
