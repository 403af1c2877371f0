"""Bad input is refused before any weight moves, with the numbers: heads or KV heads that do not
divide by the mode's head split, a model with no plan under a mode that needs one (naming the
modules that need a style), a model whose attention cannot become a ring; and vocab-sharded
logits are never silently mis-read."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import engine_run, global_losses, reference_run
from test_hf_parity import (
    VOCAB,
    adamw,
    as_pairs,
    dense_loss,
    exact_norms,
    hf_batches,
    lm_loss,
    tiny_model,
)

import gridtrain as gt


def _initialize_error(ctx, name: str, model_kw: dict):
    model = tiny_model(name, **model_kw)
    try:
        gt.initialize(model, adamw(model), lm_loss)
    except ValueError as err:  # PlanError is a ValueError
        return type(err).__name__, str(err)
    return None, None


def _tensor(size: int, mode: str, **kw) -> dict:
    return dict(parallel=dict(tensor=dict(size=size, mode=mode, **kw)))


@pytest.mark.parametrize(
    "name, model_kw, config, words",
    [
        ("llama", dict(num_key_value_heads=1), _tensor(2, "1d"), ["num_key_value_heads=1", "2"]),
        (
            "llama",
            dict(num_key_value_heads=1),
            _tensor(4, "2d"),
            ["num_key_value_heads=1", "q = 2"],
        ),
        ("gpt2", dict(n_head=3, n_embd=48), _tensor(4, "2d"), ["num_attention_heads=3", "q = 2"]),
    ],
)
def test_heads_not_divisible_say_which_and_by_what(name, model_kw, config, words):
    world = config["parallel"]["tensor"]["size"]
    results = run_distributed(_initialize_error, world, name, model_kw, config=config, timeout=600)
    for kind, message in results:
        assert kind == "PlanError", message
        for w in words:
            assert w in message, message


def _bloom_error(ctx):
    import transformers as tf

    cfg = tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    model = tf.BloomForCausalLM(cfg)
    try:
        gt.initialize(model, adamw(model), lm_loss)
    except ValueError as err:
        return str(err)
    return None


def test_model_without_plan_names_the_modules_needing_a_style():
    """Bloom has no _tp_plan and gridtrain has none: the styles the planner infers for its fused
    query_key_value do not fit Bloom's attention (it views the fused output with the model's
    head count), which the dry run finds before any weight moves, naming the module, the
    inferred styles inside it and the key that overrides them."""
    message = run_distributed(_bloom_error, 2, config=_tensor(2, "1d"), timeout=600)[0]
    assert message is not None and "'transformer.h.0.self_attention'" in message, message
    assert "transformer.h.0.self_attention.query_key_value" in message, message
    assert "parallel.tensor.plan" in message, message
    message = run_distributed(_bloom_error, 2, config=_tensor(2, "sequence"), timeout=600)[0]
    assert "AttentionInterface" in message and "ring attention" in message, message


def _logits(ctx, plan: dict | None):
    model = tiny_model("gpt2")
    engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    x, m, y = hf_batches(steps=1)[0]
    out = engine(input_ids=x, attention_mask=m)
    width = out.logits.shape[-1]
    try:  # what a user writes with V = the vocabulary size
        loss = gt.nn.CrossEntropyLoss()(out.logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    except ValueError as err:
        loss = str(err)
    return width, loss


def test_logits_are_gathered_by_default_and_sharded_ones_never_misread():
    ref = tiny_model("gpt2")
    x, m, y = hf_batches(steps=1)[0]
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            ref(input_ids=x, attention_mask=m).logits.reshape(-1, VOCAB), y.reshape(-1)
        )
    for width, loss in run_distributed(_logits, 2, None, config=_tensor(2, "1d"), timeout=600):
        assert width == VOCAB  # gathered: reshape(-1, V) is the dense layout
        assert loss == pytest.approx(want.item(), rel=1e-12)
    sharded = _tensor(2, "1d", plan={"lm_head": "vocab_parallel"})
    for width, loss in run_distributed(_logits, 2, None, config=sharded, timeout=600):
        assert width == VOCAB // 2
        assert isinstance(loss, str) and "must be labels" in loss, loss  # an error, not a number


def _labels_to_model(ctx):
    model = tiny_model("llama")
    engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    x, m, y = hf_batches(steps=1)[0]
    try:
        engine(input_ids=x, attention_mask=m, labels=y)
    except ValueError as err:
        return str(err)
    return None


def test_sequence_refuses_labels_given_to_the_model():
    """HF shifts labels= inside the model: across sequence shards that would be wrong."""
    for message in run_distributed(_labels_to_model, 2, config=_tensor(2, "sequence"), timeout=600):
        assert message is not None and "shift the labels yourself" in message, message


class ShiftedEmbedding(torch.nn.Embedding):
    """Does more than look up rows: a parallel embedding replacing it would drop the shift."""

    def forward(self, ids):
        return super().forward(ids) + 1.0


def _swap_error(ctx, path: str):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class DoubledRMSNorm(LlamaRMSNorm):  # neither weight * x / rms(x) nor (1 + weight) * ...
        def forward(self, x):
            return 2 * super().forward(x)

    model = tiny_model("llama")
    old = model.get_submodule(path)
    new = DoubledRMSNorm(old.weight.shape[0], old.variance_epsilon)
    model.set_submodule(path, new.to(torch.float64))
    try:
        gt.initialize(model, adamw(model), lm_loss)
    except ValueError as err:
        return type(err).__name__, str(err)
    return None, None


def test_a_norm_replaced_by_something_else_is_refused_by_name():
    """Under 2d the planner replaces every norm: one whose forward differs from what
    gridtrain's norms compute is named before any weight moves."""
    words = ["'model.norm'", "DoubledRMSNorm", "(1 + weight)"]
    for kind, message in run_distributed(_swap_error, 4, "model.norm", config=_tensor(4, "2d")):
        assert kind == "PlanError", message
        for w in words:
            assert w in message, message


class NormedEmbedding(torch.nn.Embedding):
    """Normalises each row over the embedding dim (as Inkling's and MuseSpark's embeddings
    do): run on a block of the table's columns it would normalise over the block."""

    def forward(self, ids):
        return torch.nn.functional.normalize(super().forward(ids), dim=-1)


def _normed_error(ctx):
    model = tiny_model("llama")
    old = model.model.embed_tokens
    model.model.embed_tokens = NormedEmbedding(old.num_embeddings, old.embedding_dim)
    model.to(torch.float64)
    try:
        gt.initialize(model, adamw(model), lm_loss)
    except ValueError as err:
        return type(err).__name__, str(err)
    return None, None


def test_an_embedding_mixing_its_columns_is_refused_under_2d():
    """The grid runs an embedding's own forward on a block of its columns: one that mixes
    columns is named before any weight moves (it would normalise over a quarter of the row)."""
    for kind, message in run_distributed(_normed_error, 4, config=_tensor(4, "2d")):
        assert kind == "PlanError", message
        for w in ("'model.embed_tokens'", "NormedEmbedding", "mixes columns"):
            assert w in message, message


def _shifted_llama():
    model = tiny_model("llama")
    old = model.model.embed_tokens
    new = ShiftedEmbedding(old.num_embeddings, old.embedding_dim).to(torch.float64)
    new.weight.data.copy_(old.weight.data)
    model.model.embed_tokens = new
    return exact_norms(model)


def _train_shifted(ctx, batches):
    example = dict(input_ids=batches[0][0][:4])
    return engine_run(
        ctx, _shifted_llama, as_pairs(batches), lm_loss, adamw, example_inputs=example
    )


def test_an_embedding_with_its_own_forward_keeps_it_under_2d():
    """Under 2d the embedding's table is split 4 ways and the user's own forward (here: the
    lookup plus one) runs on this rank's block: losses equal one process's, and differ from
    the model without the shift by far more, so a dropped forward would fail."""
    batches = hf_batches(steps=2)
    ref = reference_run(_shifted_llama, as_pairs(batches), dense_loss, adamw)
    plain = reference_run(
        lambda: exact_norms(tiny_model("llama")), as_pairs(batches), dense_loss, adamw
    )
    runs = run_distributed(_train_shifted, 4, batches, config=_tensor(4, "2d"))
    losses = torch.tensor(global_losses(runs), dtype=torch.float64)
    want = torch.tensor(ref.losses, dtype=torch.float64)
    # float64: sharded matmuls and collectives only reorder sums (measured <= 1e-13)
    assert (losses - want).abs().max().item() <= 1e-10, (losses, want)
    assert (want - torch.tensor(plain.losses)).abs().max().item() > 1e-3, (want, plain.losses)
    for run in runs:  # really split: each rank holds a quarter of the table
        assert run.shares["model.embed_tokens.weight"] == pytest.approx(1 / 4), run.shares


def _kept_embedding(ctx):
    model = tiny_model("llama")
    old = model.model.embed_tokens
    model.model.embed_tokens = ShiftedEmbedding(old.num_embeddings, old.embedding_dim)
    model.to(torch.float64)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    want = model.model.embed_tokens(x)
    engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    kept = engine.model.model.embed_tokens
    return type(kept).__name__, torch.equal(kept(x), want)


def test_an_embedding_kept_whole_by_the_plan_keeps_its_forward():
    """The refusal above advises keeping the embedding whole: under 1d with that plan entry,
    the user's embedding stays, shift included (no tensor-parallel embedding replaces it)."""
    config = _tensor(2, "1d", plan={"model.embed_tokens": "replicate"})
    for name, same in run_distributed(_kept_embedding, 2, config=config):
        assert name == "ShiftedEmbedding" and same, name


def test_unequal_packed_blocks_are_refused_by_name():
    """Phi-3 with grouped key/value heads: q, k and v differ in width; a config plan asking for
    equal packed blocks would give each rank the wrong heads."""
    config = _tensor(2, "1d", plan={"model.layers.*.self_attn.qkv_proj": "packed_colwise"})
    for kind, message in run_distributed(_initialize_error, 2, "phi3", {}, config=config):
        assert kind == "PlanError", message
        for w in ("'model.layers.0.self_attn.qkv_proj'", "4 query heads and 2 + 2", "unequal"):
            assert w in message, message
