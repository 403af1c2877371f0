"""The GPT demo model: dense properties, and 1d tensor parallelism equal to the dense model."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import tensor_of
from helpers.runs import assert_grads_close, engine_run, reference_run, token_batches

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from demos.gpt import data as gpt_data  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402

# the "tiny" preset shrunk to test size: 4 heads so 1d TP 4 holds one head per rank
CFG = gpt_model.preset("tiny", n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
STEPS, LR = 3, 1e-2


def _batches(cfg=CFG, n=STEPS, batch=4, seq=12):
    """(ids, next-token labels) pairs."""
    return token_batches(n, batch, seq, cfg.vocab_size, seed=7)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


# ---- dense (no parallel context) --------------------------------------------------------------
def test_param_count_formula_matches_module():
    for cfg in (CFG, gpt_model.preset("tiny"), gpt_model.preset("tiny", bias=False)):
        model = gpt_model.GPT(cfg)
        counted = sum(p.numel() for p in model.parameters())  # tied weight counted once
        assert cfg.num_params() == counted
        assert cfg.num_params(embeddings=False) == counted - cfg.block_size * cfg.n_embd


def test_gpt2_sizes():
    # GPT-2 124M / 350M with the BPE vocabulary padded to 50304
    assert round(gpt_model.preset("small").num_params() / 1e6) == 124
    assert round(gpt_model.preset("medium").num_params() / 1e6) == 355


def test_head_is_tied_and_layers_are_ordered():
    model = gpt_model.GPT(CFG)
    assert model.head.classifier.weight is model.embed.tok.weight
    names = [n for n, _ in model.named_children()]
    assert names == ["embed", *[f"h{i}" for i in range(CFG.n_layer)], "head"]
    assert model.pipeline_layers() == list(model.children())
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    out = x
    for layer in model.pipeline_layers():  # the cut list composes to the model
        out = layer(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_init_is_seeded_and_gpt2_scaled():
    a, b = gpt_model.GPT(CFG, seed=3), gpt_model.GPT(CFG, seed=3)
    for (k, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), k
    sd = a.state_dict()
    # N(0, 0.02) and N(0, 0.02/sqrt(2L)); sample std of >= 1k draws is within 10%
    assert abs(sd["h0.mlp.fc.weight"].std().item() - 0.02) < 0.002
    resid = 0.02 / math.sqrt(2 * CFG.n_layer)
    assert abs(sd["h1.attn.proj.weight"].std().item() - resid) < 0.1 * resid
    assert torch.equal(sd["h0.ln_1.weight"], torch.ones(CFG.n_embd))
    assert torch.equal(sd["h0.attn.qkv.bias"], torch.zeros(3 * CFG.n_embd))


def test_attention_is_causal():
    model = gpt_model.GPT(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 10))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % CFG.vocab_size  # change only the future of position 5
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)  # same ops, same inputs
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_head_major_qkv_splits_into_whole_heads():
    """A contiguous split of qkv's output (what a column-parallel Linear keeps) is a set of
    whole heads: attention on each part, concatenated, equals attention on all heads."""
    torch.manual_seed(0)
    attn = gpt_model.CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 8, CFG.n_embd)
    with torch.no_grad():
        full = attn(x)
        for parts in (2, 4):
            ys = []
            for w, b in zip(attn.qkv.weight.chunk(parts), attn.qkv.bias.chunk(parts), strict=True):
                part = copy.deepcopy(attn)
                part.qkv.weight, part.qkv.bias = torch.nn.Parameter(w), torch.nn.Parameter(b)
                part.proj = torch.nn.Identity()  # the row-parallel proj is applied after concat
                ys.append(part(x))
            y = attn.proj(torch.cat(ys, dim=-1))
            # same per-head math; only the proj matmul order is shared, float32 rounding
            torch.testing.assert_close(y, full, rtol=1e-5, atol=1e-6)


def test_generate_greedy_and_top_k():
    model = gpt_model.GPT(CFG)
    prompt = torch.randint(0, CFG.vocab_size, (1, 4))
    a = gpt_model.generate(model, prompt, 20, temperature=0)  # longer than block_size: cropped
    b = gpt_model.generate(model, prompt, 20, temperature=0)
    assert a.shape == (1, 24) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    g = torch.Generator().manual_seed(0)
    c = gpt_model.generate(model, prompt, 5, top_k=1, generator=g)  # top-1 sampling = greedy
    assert torch.equal(c, a[:, :9])


def test_bad_config_and_sequence_rejected():
    with pytest.raises(ValueError, match="n_embd 30 is not divisible by n_head 4"):
        gpt_model.preset("tiny", n_embd=30)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        gpt_model.preset("huge")
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size 16"):
        gpt_model.GPT(CFG)(torch.zeros(1, 17, dtype=torch.long))


def test_byte_corpus_windows():
    text = gpt_data.load_corpus()
    assert len(text) > 400_000 and text == gpt_data.load_corpus()  # embedded, fixed order
    train, held = gpt_data.split_corpus(text, held_out=0.1)
    assert len(train) + len(held) == len(text) and abs(len(held) / len(text) - 0.1) < 1e-3
    ds = gpt_data.WindowDataset(train, seq_len=64)
    assert len(ds) == (len(train) - 65) // 64 + 1
    x, y = ds[3]
    assert torch.equal(x[1:], y[:-1]) and torch.equal(x, train[192:256])
    assert gpt_data.decode(gpt_data.encode("héllo")) == "héllo"
    with pytest.raises(ValueError, match="shorter than one window"):
        gpt_data.WindowDataset(train[:10], seq_len=64)
    with pytest.raises(FileNotFoundError, match="--data file 'nope.txt' does not exist"):
        gpt_data.load_corpus("nope.txt")


# ---- tensor parallelism through the engine ---------------------------------------------------
def _tp_run(ctx, cfg, batches):
    """The demo model sharded by gt.initialize, trained through the engine; also the layer
    kinds the plan chose and the demo's own ``dense_copy`` after training."""

    def kinds_and_copy(engine):
        names = ("h0.attn.qkv", "h0.mlp.fc2")
        kinds = {n: type(engine.model.get_submodule(n)).__name__ for n in names}
        return kinds, gpt_model.dense_copy(engine.model, cfg).state_dict()  # collective

    build = lambda: gpt_model.GPT(cfg, seed=0)  # noqa: E731
    example = batches[0][0]
    return engine_run(
        ctx,
        build,
        batches,
        gpt_model.GPTLoss(),
        _adamw,
        probe=kinds_and_copy,
        initial=True,
        example_inputs=example,
    )


def test_gt_nn_layers_are_plain_modules():
    model = gpt_model.GPT(CFG)
    assert isinstance(model.h0.attn.qkv, torch.nn.Linear)
    assert isinstance(model.embed.tok, torch.nn.Embedding)
    assert model.h0.attn.qkv.weight.shape == (3 * CFG.n_embd, CFG.n_embd)


# name: (world, tensor config, global batch, the share of h0.mlp.fc.weight each rank holds)
LAYOUTS = {
    "1d2": (2, tensor_of("1d2"), 4, 1 / 2),
    "1d4": (4, tensor_of("1d4"), 4, 1 / 4),
    "2d": (4, tensor_of("2d4"), 8, 1 / 4),  # a 2 x 2 grid of blocks
    "2.5d": (8, tensor_of("2.5d8"), 8, 1 / 4),
    "3d": (8, tensor_of("3d8"), 8, 1 / 8),  # a 2 x 2 x 2 cube
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_tensor_mode_equals_dense_after_adamw_steps(name):
    world, tensor, batch, share = LAYOUTS[name]
    batches = _batches(batch=batch)
    ref = reference_run(lambda: gpt_model.GPT(CFG, seed=0), batches, gpt_model.GPTLoss(), _adamw)
    dense_init, dense_losses = ref.states[0], ref.losses
    config = dict(parallel=dict(tensor=tensor))
    results = run_distributed(_tp_run, world, CFG, batches, config=config, timeout=300)
    for rank, run in enumerate(results):
        init, losses, final = run.states[0], run.losses, run.state
        kinds, copied = run.probed
        if tensor["mode"] == "1d":  # the traced plan pairs qkv/proj and fc/fc2
            assert kinds == {"h0.attn.qkv": "ColumnLinear", "h0.mlp.fc2": "RowLinear"}, kinds
        # each rank holds only its block of the weight (a full replica would hold 1.0)
        got = run.shares["h0.mlp.fc.weight"]
        assert got == pytest.approx(share), (name, rank, got)
        assert init.keys() == dense_init.keys()
        for k, v in dense_init.items():
            # each rank cut its shard from the same dense weights: bit-identical
            assert torch.equal(init[k], v), (rank, k)
        # every shard's gradient, as the optimizer stepped with it; split matmuls and
        # all-reduces reorder float32 sums (measured <= 7.5e-8 on gradients up to 0.39)
        assert_grads_close(run.grads[0], ref, msg=f"rank {rank}", rtol=1e-4, atol=1e-6)
        # same float32 reordering on O(4) losses: measured <= 2.3e-7 relative
        assert losses == pytest.approx(dense_losses, rel=1e-5), rank
        for k, v in ref.state.items():
            # AdamW's first steps move each element by ~lr * sign(grad): an element whose
            # gradient is rounding noise (e.g. attention keys at near-uniform attention) may
            # move differently by a fraction of lr (measured 2.7e-4 = 0.03 lr at tp 2)
            torch.testing.assert_close(final[k], v, rtol=0, atol=0.1 * LR, msg=f"rank {rank} {k}")
            assert torch.equal(copied[k], final[k]), "dense_copy holds the full weights"


# ---- the training script, end to end ------------------------------------------------------------
def _run_train_script(rank, world_size, port, config, argv):
    """``demos/gpt/train.py``'s main as torchrun would start it (env vars restored after)."""
    import os

    from demos.gpt import train

    env = dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GRIDTRAIN_CONFIG=str(config),
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return train.main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


TRAIN_ARGV = ["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1"]
TRAIN_ARGV += ["--sample-tokens", "4", "--warmup", "2"]


def test_train_script_same_losses_in_every_layout():
    configs = REPO / "demos/gpt/configs"
    runs = {
        name: run_distributed(
            _run_train_script, world, configs / f"{name}.py", TRAIN_ARGV, launch=False, timeout=300
        )
        for name, world in (("none", 1), ("dp2_tp2", 4), ("seq2", 2))
    }
    reference = runs["none"][0]
    assert reference["losses"][-1] < reference["losses"][0]  # it learns
    for name in ("dp2_tp2", "seq2"):
        for rank, result in enumerate(runs[name]):
            # same weights and global batches; float32 sums reordered by the split
            # (measured ~1e-7 relative)
            assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), (name, rank)
            assert result["held_out"] == pytest.approx(reference["held_out"], rel=1e-5), name
