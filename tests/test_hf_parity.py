"""Hugging Face GPT-2 and Llama train under every layout from the config alone, with the losses
and weights of the same model trained in one plain process, each rank holding only its share.

The user code is the plain HF loop: ``engine(input_ids=..., attention_mask=...)`` returns the
HF output object and ``gt.nn.CrossEntropyLoss()`` reads ``out.logits.reshape(-1, V)``; a
pipeline takes dict batches (``input_ids``, ``attention_mask``, ``labels``). Batches carry
padding holes in the middle of some rows, so the mask must reach every stage and every shard
of the ring. Other ``test_hf_*`` files import the tiny models from here.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.runs import assert_grads_close, engine_run, global_losses, reference_run, seeded

import gridtrain as gt

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 128
PM = gt.ParallelMode


def tiny_config(name: str, **kw):
    """hidden 64, 4 heads (Llama: 2 KV heads), 2 layers, no dropout."""
    import transformers as tf

    if name == "gpt2":
        base = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32)
        base.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        base.update(bos_token_id=0, eos_token_id=0)
        return tf.GPT2Config(**{**base, **kw})
    cls = {
        "llama": tf.LlamaConfig,
        "qwen2": tf.Qwen2Config,
        "mistral": tf.MistralConfig,
        "phi3": tf.Phi3Config,
        "gemma": tf.GemmaConfig,
    }[name]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    base.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    base.update(bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if name in ("mistral", "phi3"):
        base["sliding_window"] = None
    if name == "gemma":
        base["head_dim"] = 16  # Gemma's own default is 256, whatever the hidden size
    return cls(**{**base, **kw})


def tiny_model(name: str, dtype=torch.float64, **kw):
    """The seeded tiny causal LM (the same weights on every rank)."""
    import transformers as tf

    def build():
        return tf.AutoModelForCausalLM.from_config(
            tiny_config(name, **kw), attn_implementation="sdpa"
        )

    return seeded(build, seed=0, dtype=dtype)


def hf_batches(steps: int = STEPS, batch: int = BATCH, seq: int = SEQ, holes: bool = True):
    """(input_ids, attention_mask, labels): labels already shifted (next token), -100 on
    padding; odd rows have padding holes at positions 2-3 and 9-10 (both halves of a split)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        mask = torch.ones(batch, seq, dtype=torch.long)
        if holes:
            mask[1::2, 2:4] = 0
            mask[1::2, 9:11] = 0
        y = y.masked_fill(mask == 0, -100)
        out.append((x, mask, y))
    return out


def lm_loss(out, labels):
    """What a user writes: cross entropy of the HF output's logits, any layout."""
    logits = out.logits
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _exact_rms(self, h):
    """RMSNorm in the model's dtype (HF's rounds to float32 inside); Gemma's scales by 1 + w."""
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    scale = 1 + self.weight if type(self).__name__.startswith("Gemma") else self.weight
    return scale * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def exact_norms(model):
    """Every RMSNorm of ``model`` without its float32 round trip (see TOL); returns it."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_exact_rms, module)
    return model


def as_pairs(batches) -> list:
    """``hf_batches`` as the harness's (inputs, labels): HF keyword inputs and the labels."""
    return [(dict(input_ids=x, attention_mask=m), y) for x, m, y in batches]


def _build(name: str, exact: bool, model_kw: dict):
    model = tiny_model(name, **model_kw)
    return exact_norms(model) if exact else model


def dense_loss(out, labels):
    """The plain HF loop's loss: cross entropy of the logits, -100 ignored."""
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


def train_dense(name: str, batches, exact: bool = False, **model_kw):
    """The plain HF loop. ``exact``: RMSNorm without its float32 round trip (see TOL)."""
    return reference_run(
        lambda: _build(name, exact, model_kw), as_pairs(batches), dense_loss, adamw
    )


def train_engine(ctx, name: str, batches, exact: bool = False, model_kw: dict | None = None):
    """The same through ``gt.initialize``: the harness's run, and the attention the model's
    config names after it (ring attention under sequence parallelism)."""
    model = _build(name, exact, model_kw or {})
    example = dict(input_ids=batches[0][0][:4])
    run = engine_run(ctx, lambda: model, as_pairs(batches), lm_loss, adamw, example_inputs=example)
    return run, getattr(model.config, "_attn_implementation", None)


def _cfg(pipeline=1, tensor=None, micro=None):
    par = dict(pipeline=pipeline)
    if tensor:
        par["tensor"] = tensor
    cfg = dict(parallel=par)
    if micro:
        cfg["num_microbatches"] = micro
    return cfg


# name: (world, config, share of a sharded block weight)
LAYOUTS = {
    "dp2": (2, _cfg(), 1.0),
    "1d2": (2, _cfg(tensor=dict(size=2, mode="1d")), 1 / 2),
    "dp2-1d2": (4, _cfg(tensor=dict(size=2, mode="1d")), 1 / 2),
    "2d4": (4, _cfg(tensor=dict(size=4, mode="2d")), 1 / 4),
    "2.5d8-depth2": (8, _cfg(tensor=dict(size=8, mode="2.5d", depth=2)), 1 / 4),
    "3d8": (8, _cfg(tensor=dict(size=8, mode="3d")), 1 / 8),
    "seq2": (2, _cfg(tensor=dict(size=2, mode="sequence")), 1.0),
    "pp2": (2, _cfg(pipeline=2, micro=4), 1.0),
    "dp2-1d2-pp2": (8, _cfg(pipeline=2, tensor=dict(size=2, mode="1d"), micro=2), 1 / 2),
}
BLOCK_WEIGHT = {
    "gpt2": "transformer.h.0.mlp.c_fc.weight",
    "llama": "model.layers.0.mlp.up_proj.weight",
}
# float64 throughout, so sharded matmuls and collectives only reorder sums (<= 1e-13).
TOL = 1e-10
# The Llama family's RMSNorm rounds to float32 inside (hidden.to(torch.float32)); under
# 2d/2.5d/3d the grid's norm computes in float64, so there the reference is the same HF
# model with that round trip removed (held to TOL), and the unmodified HF model's losses
# must agree to float32 rounding (measured 1e-7 relative; AdamW then amplifies weight
# differences on near-zero gradients up to ~1e-3, so weights are not compared to it).
FLOAT32_NORM_TOL = 1e-6


# Gemma's norm scales by 1 + weight, the weight starting at 0: with float32 rounding inside,
# AdamW turns the noise on near-zero gradients into O(lr) weight differences, so for Gemma
# both sides run the norm in float64 in every layout (the unmodified model's losses are
# still held to FLOAT32_NORM_TOL).
EXACT_EVERYWHERE = ("gemma",)
# pipeline stages are balanced: no rank holds more than this share of a 2-layer model's
# parameters (its embedding and head each smaller than a layer)
STAGE_SHARE = 0.6


def _grid_rms(name: str, layout: str) -> bool:
    return name != "gpt2" and any(m in layout for m in ("2d", "2.5d", "3d"))


NAMES = ["gpt2", "llama"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_hf_model_equals_one_process(name, layout):
    check_layout(name, layout, together=[(n, {}) for n in NAMES])


def _cell(name: str, model_kw: dict) -> tuple:
    """What one model's run depends on (``train_engine``'s arguments), hashable."""
    return name, name in EXACT_EVERYWHERE, tuple(sorted(model_kw.items()))


def _train_cells(ctx, cells: tuple, batches) -> list:
    """Each of ``cells`` through a ``gt.initialize`` of its own, one after the other."""
    return [train_engine(ctx, name, batches, exact, dict(kw)) for name, exact, kw in cells]


@functools.cache
def _launch(layout: str, cells: tuple) -> dict:
    """Cell -> every rank's ``train_engine`` results: one launch per layout trains all the
    models checked under it (a launch of 8 ranks costs seconds of CPU on 2 cores; the runs
    themselves are the same as with one launch each)."""
    world, config, _ = LAYOUTS[layout]
    per_rank = run_distributed(_train_cells, world, cells, hf_batches(), config=config, timeout=600)
    return {cell: [rank[i] for rank in per_rank] for i, cell in enumerate(cells)}


@functools.cache
def _dense(name: str, exact: bool, kw: tuple):
    """The plain run, once per model (several layouts compare with the same one)."""
    return train_dense(name, hf_batches(), exact=exact, **dict(kw))


def check_layout(name: str, layout: str, block: str | None = None, together=(), **model_kw) -> list:
    """Train ``name`` under ``layout`` and in one process; assert parity, each rank's share
    of ``block`` (a block weight) and, under a pipeline, each stage's share of the model.
    ``together``: the (name, model_kw) of every model checked under ``layout``, trained in
    the same launch. Returns every rank's results (``train_engine``)."""
    world, config, share = LAYOUTS[layout]
    exact = name in EXACT_EVERYWHERE
    cell = _cell(name, model_kw)
    ref = _dense(name, exact or _grid_rms(name, layout), cell[2])
    d_losses, d_final = ref.losses, ref.state
    cells = tuple(dict.fromkeys([*(_cell(n, kw) for n, kw in together), cell]))
    results = _launch(layout, cells)[cell]
    replica = world // gt.Config.from_dict(config).data_size(world)
    losses = torch.tensor(global_losses([r for r, _ in results]), dtype=torch.float64)
    tol = TOL
    err = (losses - torch.tensor(d_losses, dtype=torch.float64)).abs().max().item()
    if exact or _grid_rms(name, layout):
        hf_run = _dense(name, False, cell[2])
        hf_losses = torch.tensor(hf_run.losses, dtype=torch.float64)
        hf_err = ((losses - hf_losses).abs() / hf_losses.abs()).max().item()
        print(f"\nLAYOUT {name} {layout}: vs unmodified HF (float32 RMSNorm) {hf_err:.2e}")
        assert hf_err <= FLOAT32_NORM_TOL, (name, layout, hf_err)
    total = sum(p.numel() for p in tiny_model(name, **model_kw).parameters())
    w_err = 0.0
    for rank, (run, attn) in enumerate(results):
        tag = f"{name} {layout} rank {rank}"
        final, grads, held, plan = run.state, run.grads[0], run.shares, run.plan
        assert run.losses == results[rank - rank % replica][0].losses, f"{tag}: one per replica"
        if layout.startswith("seq"):  # the model's own attention call reached ring attention
            assert attn == "gridtrain_ring", (tag, attn)
        assert set(final) == set(d_final), f"{tag}: full state dict has the plain model's keys"
        # every parameter's first-step gradient, as the optimizer stepped with it
        assert_grads_close(grads, ref, msg=tag, rtol=tol * 100, atol=tol)
        for k, v in d_final.items():
            w_err = max(w_err, (final[k] - v).abs().max().item())
            # AdamW divides by sqrt(v) + 1e-8: a 1e-16 gradient difference on a near-zero
            # gradient moves a weight by up to lr * 1e-8; a wrong shard moves it O(lr)
            torch.testing.assert_close(
                final[k], v, rtol=1e-4, atol=max(1e-7, tol * 100), msg=f"{tag} {k}"
            )
        block = block or BLOCK_WEIGHT.get(name, "model.layers.0.mlp.up_proj.weight")
        if block in held:  # really cut: a replica would hold 1.0
            assert held[block] == pytest.approx(share), (tag, held[block])
        if "tensor" in config["parallel"] and config["parallel"]["tensor"]["mode"] != "sequence":
            assert "auto" in plan or "rowwise" in plan, plan
        if config["parallel"]["pipeline"] > 1:  # balanced stages, a tied copy counted
            assert run.held / total <= STAGE_SHARE, (tag, run.held, total)
    print(f"\nLAYOUT {name} {layout}: max loss error {err:.2e}, max weight error {w_err:.2e}")
    assert err <= tol * max(1.0, max(d_losses)), (name, layout, err)
    return results
