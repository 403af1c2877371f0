"""Hub checkpoints in a family's original per-expert layout load into any expert layout.

Most hub checkpoints (and older ``transformers``) store each expert's projections under keys
of their own (Mixtral: ``model.layers.0.block_sparse_moe.experts.3.w1.weight``; Qwen2-MoE and
Qwen3-MoE: ``model.layers.0.mlp.experts.3.gate_proj.weight``), where the installed
``transformers`` fuses them into ``[num_experts, ...]`` tensors. The test writes such a
checkpoint itself from a tiny model's fused weights, split per expert, over two files with
an index (as hub checkpoints are sharded, one layer's experts in both). ``transformers``' own
``from_pretrained`` must read it back as those weights (it is the layout transformers
knows), and ``gridtrain.hf.load_pretrained`` must load it into a model holding other weights
under ep 1, ep 2 and 1d2 x ep2: ``gt.full_state_dict`` equal to the fused weights bit for bit,
each rank holding only its experts, and the first step's loss equal to the one-process
model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hf_moe import adamw, dense_moe_loss, expert_keys, moe_batches, moe_loss, tiny_moe
from helpers.layouts import layout
from helpers.runs import data_rows, engine_step, global_loss, shares

import gridtrain as gt
import gridtrain.hf as gthf

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# family -> (the block's name in the original keys, gate, up and down projections' names)
ORIGINAL = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}
COEF = 0.1


def per_expert(family: str, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original layout of ``fused`` (the model's own keys): ``gate_up_proj`` [E, 2f, h]
    split into each expert's gate and up ``[f, h]``, ``down_proj`` [E, h, f] into each
    expert's ``[h, f]``; Mixtral's ``mlp`` blocks named ``block_sparse_moe``."""
    block, gate, up, down = ORIGINAL[family]
    out = {}
    for key, value in fused.items():
        key = key.replace(".mlp.", f".{block}.")
        if key.endswith(".experts.gate_up_proj"):
            stem = key.removesuffix("gate_up_proj")
            for e, (g, u) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                out[f"{stem}{e}.{gate}.weight"] = g.clone()
                out[f"{stem}{e}.{up}.weight"] = u.clone()
        elif key.endswith(".experts.down_proj"):
            stem = key.removesuffix("down_proj")
            for e, d in enumerate(value):
                out[f"{stem}{e}.{down}.weight"] = d.clone()
        else:
            out[key] = value.clone()
    return out


def write_original(directory, family: str, model, drop: str | None = None) -> None:
    """``model``'s config and its weights in the original layout (without the key ``drop``):
    two safetensors files (alternate keys in each) and the index that maps them."""
    from safetensors.torch import save_file

    model.config.save_pretrained(directory)
    state = per_expert(family, model.state_dict())
    state.pop(drop, None)
    names = sorted(state)
    where = {k: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, k in enumerate(names)}
    for file in set(where.values()):
        save_file({k: v for k, v in state.items() if where[k] == file}, directory / file)
    index = {"metadata": {}, "weight_map": where}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (its directory, the fused weights, the first batch's loss in one process)."""
    import transformers as tf

    out = {}
    x, y = moe_batches(1)[0]
    for family in FAMILIES:
        model = tiny_moe(family)
        directory = tmp_path_factory.mktemp(family)
        write_original(directory, family, model)
        fused = {k: v.clone() for k, v in model.state_dict().items()}
        assert any(".experts.0." in k for k in json.loads(
            (directory / "model.safetensors.index.json").read_text())["weight_map"])  # fmt: skip
        ref = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
        back = ref.state_dict()
        assert set(back) == set(fused), set(back) ^ set(fused)
        for key, value in fused.items():  # transformers reads the layout: it is the original
            assert torch.equal(back[key], value), f"from_pretrained {family}: {key}"
        with torch.no_grad():
            loss = dense_moe_loss(COEF)(ref(**x), y).item()
        out[family] = (str(directory), fused, loss)
    return out


def _load(ctx, directories: dict[str, str]):
    """Each family: a model with other weights, loaded from its directory, one step."""
    out = {}
    x, y = data_rows(moe_batches(1)[0], ctx)
    for family, directory in directories.items():
        model = tiny_moe(family)
        dense = {n: p.numel() for n, p in model.named_parameters()}
        keys = expert_keys(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a load that does nothing shows
        engine, *_ = gt.initialize(model, adamw(model), moe_loss(COEF))
        gthf.load_pretrained(engine.model, directory)
        state = gt.full_state_dict(engine.model)
        held = {k: v for k, v in shares(engine, dense).items() if k in keys}
        out[family] = (state, held, engine_step(engine, x, y, ctx))
    return out


LAYOUTS = {
    "ep2": (*layout("ep2-dp2"), 2),
    "ep1": (*layout("ep1"), 1),
    "1d2-ep2": (*layout("ep2-dp4-1d2"), 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_expert_checkpoint_loads_fused(saved, layout):
    world, config, ep = LAYOUTS[layout]
    directories = {f: d for f, (d, _, _) in saved.items()}
    ranks = run_distributed(_load, world, directories, config=config)
    for family, (_, fused, want_loss) in saved.items():
        for rank, loaded in enumerate(ranks):
            state, held, _ = loaded[family]
            tag = f"{family} {layout} rank {rank}"
            # each rank holds only its experts: a load into whole experts would not show
            assert held and all(share == 1 / ep for share in held.values()), (tag, held)
            assert set(state) == set(fused), (tag, set(state) ^ set(fused))
            for key, value in fused.items():  # copied, never computed: bit for bit
                assert torch.equal(state[key], value), f"{tag}: {key}"
        loss = global_loss([loaded[family][2] for loaded in ranks])
        # float32 forward of the same weights and tokens: only summation order differs
        # (the experts' rows are summed per rank, the loss over data ranks), ~1e-7;
        # a wrong expert or a gate/up swap moves the loss by 1e-2 and more
        assert loss == pytest.approx(want_loss, rel=1e-5), (family, layout, loss, want_loss)


def test_an_expert_short_is_refused_naming_the_fused_key(tmp_path):
    """One process, no layout: a checkpoint that lacks one expert's up projection cannot be
    fused; the error names the model's key and what it converts from, nothing is loaded."""
    model = tiny_moe("mixtral")
    write_original(
        tmp_path, "mixtral", model, drop="model.layers.1.block_sparse_moe.experts.3.w3.weight"
    )
    target = tiny_moe("mixtral")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(gthf.PretrainedMismatchError) as err:
        gthf.load_pretrained(target, tmp_path)
    message = str(err.value)
    assert "'model.layers.1.mlp.experts.gate_up_proj (converted from" in message, message
    assert "block_sparse_moe.experts.0.w1.weight" in message, message
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
