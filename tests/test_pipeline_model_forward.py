"""Under pipeline parallelism every stage runs the Hugging Face model's own forward, so what a
family does around its layers happens on the stage that owns it:

* Gemma2's final logit soft cap (and its attention soft cap, inside its layers);
* Granite's embedding multiplier, logits scaling and residual multiplier;
* Cohere's logit scale;
* GPT-2 with ``token_type_ids`` in the batch (its forward embeds them with ``wte``);
* a user's subclass of ``LlamaForCausalLM`` whose forward tempers the logits.

Each trains under pp2 (and Granite under interleaved pp2 x 2 chunks) with the losses, the
first step's gradients and the weights after three AdamW steps of the same model trained in
one plain process (float64), each rank holding only its stage's parameters, and every
parameter on some stage under its dense name. Batches carry padding holes, so the mask must
reach every stage. Without the model's own forward on each stage (soft caps, multipliers,
scales or the subclass's forward dropped, as stages rebuilding the forward from pieces did)
the losses differ by 9e-4 to 1.7e-2, against a tolerance of 5e-10. Llama also trains with its
stage's blocks checkpointed and compiled, and under ZeRO 3 (FSDP2) on dp2 x pp2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from helpers.harness import run_distributed
from helpers.runs import assert_grads_close, engine_run, global_losses, reference_run, seeded
from test_hf_parity import VOCAB, adamw, hf_batches, lm_loss

STEPS = 3
# float64: a stage computes what one process computes, the micro-batch sums only reorder
# the gradient's (relative error <= 1e-13)
TOL = 1e-10
# Gemma2's and Cohere's norms multiply by their weight in float32 (``weight.float()``), so
# those weights' gradients are float32 sums over the tokens, summed in another order over
# micro-batches than over the whole batch
FLOAT32_GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
FLOAT32_NORMS = ("gemma2", "cohere")
# AdamW divides by sqrt(v) + 1e-8: a 1e-16 gradient difference on a near-zero gradient moves
# a weight by up to lr * 1e-8 per step; a dropped scale or soft cap moves it O(lr) = 1e-2
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-7)
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
SMALL.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
SMALL.update(bos_token_id=0, eos_token_id=0, pad_token_id=None)


class TemperedLlama(tf.LlamaForCausalLM):
    """A user's subclass: its own forward divides the logits by 2."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits / 2.0
        return out


def _config(name: str):
    if name == "gemma2":
        return tf.Gemma2Config(
            **SMALL, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=2.0,
            attn_logit_softcapping=5.0,
        )  # fmt: skip
    if name == "granite":
        return tf.GraniteConfig(
            **SMALL, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
            attention_multiplier=0.2,
        )  # fmt: skip
    if name == "cohere":
        return tf.CohereConfig(**SMALL, logit_scale=0.5)
    if name == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return tf.LlamaConfig(**SMALL)


def build(name: str):
    """The seeded tiny model (float64); Gemma2 with eager attention (its soft cap)."""
    attn = "eager" if name == "gemma2" else "sdpa"
    if name == "tempered_llama":
        return seeded(lambda: TemperedLlama(_config(name)).to(torch.float64))
    return seeded(
        lambda: tf.AutoModelForCausalLM.from_config(_config(name), attn_implementation=attn)
    )


def pairs(name: str) -> list:
    """(inputs, labels) with padding holes; GPT-2's inputs also carry token_type_ids."""
    out = []
    for x, m, y in hf_batches(STEPS):
        inputs = dict(input_ids=x, attention_mask=m)
        if name == "gpt2":
            inputs["token_type_ids"] = (x + 1) % VOCAB
        out.append((inputs, y))
    return out


def dense_loss(out, labels):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


def _assert_grads(grads: dict, ref, name: str, tag: str) -> None:
    """Every parameter's first-step gradient; the float32-summed norm weights of Gemma2 and
    Cohere to FLOAT32_GRAD_TOL, the rest to TOL."""
    strict = dict(rtol=TOL * 100, atol=TOL)
    assert_grads_close(
        grads, ref, msg=tag, **(FLOAT32_GRAD_TOL if name in FLOAT32_NORMS else strict)
    )
    for k, g in grads.items():
        if name in FLOAT32_NORMS and "norm" not in k:
            torch.testing.assert_close(
                g, ref.grads[0][ref.aliases.get(k, k)], msg=f"{tag} {k}", **strict
            )


def _probe(engine):
    """The stage's state-dict keys, and its blocks whose forward the engine wrapped
    (checkpointed or compiled)."""
    blocks = engine.model.get_submodule(
        "model.layers" if hasattr(engine.model, "model") else "transformer.h"
    )
    wrapped = [i for i, b in enumerate(blocks) if "forward" in vars(b)]
    return sorted(engine.model.state_dict()), wrapped


def _train(ctx, name: str):
    return engine_run(ctx, lambda: build(name), pairs(name), lm_loss, adamw, probe=_probe)


def _pp(chunks: int = 1, micro: int = 4) -> dict:
    return dict(parallel=dict(pipeline=dict(size=2, num_chunks=chunks)), num_microbatches=micro)


CASES = {
    "gemma2": _pp(),
    "granite": _pp(),
    "granite-interleaved": _pp(chunks=2),
    "cohere": _pp(),
    "gpt2": _pp(),
    "tempered_llama": _pp(micro=2),
    "llama-dp2-zero3": dict(_pp(micro=2), zero=3),  # FSDP2 units inside the stage
    # the stage's blocks checkpointed and compiled (aot_eager: dynamo and AOTAutograd, no
    # C++), hooks and the stage's stand-ins outside the graphs
    "llama-recompute-compiled": dict(
        _pp(micro=2), activation_checkpoint=True, compile=dict(backend="aot_eager")
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_stage_runs_the_models_own_forward(case):
    name = case.split("-")[0]
    world = 4 if "dp2" in case else 2
    ref = reference_run(lambda: build(name), pairs(name), dense_loss, adamw)
    results = run_distributed(_train, world, name, config=CASES[case], timeout=300)
    losses = torch.tensor(global_losses(results), dtype=torch.float64)
    err = (losses - torch.tensor(ref.losses, dtype=torch.float64)).abs().max().item()
    print(f"\nPIPELINE {case}: max loss error {err:.2e}")
    assert err <= TOL * max(ref.losses), (case, losses, ref.losses)
    dense = sum(p.numel() for p in build(name).parameters())
    held_keys = set()
    for rank, run in enumerate(results):
        tag = f"{case} rank {rank}"
        _assert_grads(run.grads[0], ref, name, tag)
        assert set(run.state) == set(ref.state), f"{tag}: the full state dict has the dense keys"
        for k, v in ref.state.items():
            torch.testing.assert_close(run.state[k], v, msg=f"{tag} {k}", **WEIGHT_TOL)
        # only this stage's parameters, under their dense names (a tied copy counted)
        keys, wrapped = run.probed
        assert 0 < run.held < dense, (tag, run.held, dense)
        assert set(keys) < set(ref.state), (tag, sorted(set(keys) - set(ref.state)))
        held_keys |= set(keys)
        if "compiled" in case:  # the stage's one block is checkpointed and compiled
            assert len(wrapped) == 1, (tag, wrapped)
    assert held_keys == set(ref.state), sorted(set(ref.state) - held_keys)


# ---- refusals: gt.PlanError, naming what is missing, on every rank ---------------------------
class EmbeddingSkipLlama(tf.LlamaForCausalLM):
    """Adds the token embedding to the logits: the last stage would need the first one's."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits + self.model.embed_tokens(input_ids).sum(-1, keepdim=True)
        return out


def _refusal(ctx, name: str, batch_extra: dict | None = None):
    """``(kind, message)`` of the first error at ``gt.initialize`` or in a forward-only step
    (no loss: the first stage does not wait for the last), else ``(None, None)``."""
    import gridtrain as gt

    if name == "opt":
        model = seeded(lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=32,
            ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32)))  # fmt: skip
    elif name == "embedding_skip":
        model = seeded(lambda: EmbeddingSkipLlama(_config("llama")))
    else:
        model = build(name)
    inputs, labels = pairs(name)[0]
    try:
        engine, *_ = gt.initialize(model, adamw(model), lm_loss)
        batch = {**inputs, **(batch_extra or {}), "labels": labels}
        engine.execute_schedule(iter([batch]), forward_only=True, return_loss=False)
    except gt.PlanError as err:
        return type(err).__name__, str(err)
    return None, None


@pytest.mark.parametrize(
    "name, config, extra, ranks, words",
    [
        ("opt", _pp(), None, [0, 1], ["OPTForCausalLM has no pipeline plan", "_pp_plan"]),
        (  # GPT-2's position embedding starts no stage: 5 places for 6 parts
            "gpt2",
            _pp(chunks=3, micro=2),
            None,
            [0, 1],
            ["cannot cut 6 layers (5 places where a part may begin) into 6 pipeline parts"],
        ),
        (
            "llama",
            _pp(micro=2),
            dict(foo=torch.zeros(8, 16)),
            [0, 1],
            ["batch keys ['foo']", "'input_ids', 'attention_mask', 'position_ids'"],
        ),
        (  # one micro-batch: the first stage's one send completes, nothing else waits
            "embedding_skip",
            _pp(micro=1),
            None,
            [1],
            ["the model's output is a value", "more than the activation would cross"],
        ),
    ],
    ids=["no-plan", "no-cut", "batch-key", "embedding-skip"],
)
def test_what_stages_cannot_run_is_refused_by_name(name, config, extra, ranks, words):
    results = run_distributed(_refusal, 2, name, extra, config=config, timeout=300)
    for rank, (kind, message) in enumerate(results):
        if rank not in ranks:
            assert kind is None, (rank, message)
            continue
        assert kind == "PlanError", (rank, message)
        for w in words:
            assert w in message, (rank, message)
