"""Under tensor mode 'sequence', ring attention computes every argument a Hugging Face model's
attention passes, or refuses it by name at ``gt.initialize``:

* Gemma2: attention soft cap (``softcap``), sliding-window layers, a ``scaling`` other than
  ``1/sqrt(head_dim)`` and the final logit soft cap, under both ring variants;
* Mistral: a sliding window shorter than the sequence;
* Granite SWA: attention sinks (``s_aux``), sliding-window layers, ``scaling``.

Each trains under sequence 2 (padding holes in the batch) with the losses, first-step
gradients and final weights of the same model in one plain process (float64), each rank
computing only its half of the positions, and would not without each argument: the model
with that one argument dropped differs by far more than the tolerance (asserted). Refused,
each a ``gt.PlanError`` naming it: an attention argument ring attention does not implement
(a bias, at ``gt.initialize``), a mask pattern it does not compute (Gemma3's bidirectional
window overlay, at ``gt.initialize``), ``output_attentions=True`` and packed sequences (at
the forward: they come with the batch).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.harness import run_distributed
from helpers.runs import engine_run, global_losses, reference_run, seeded
from test_hf_parity import SEQ, adamw, hf_batches, lm_loss
from test_pipeline_model_forward import SMALL, dense_loss
from torch import Tensor
from transformers.models.llama.modeling_llama import LlamaAttention

import gridtrain as gt

STEPS = 3
WINDOW = 4  # tokens of a sliding-window layer's view: shorter than the sequence (16)
NO_SINK = -1e4  # a sink logit whose probability is 0: the model without sinks
FAMILIES = {
    # name: (config class, its changes, the one-process reference's attention,
    #        {argument: the changes that drop it})
    "gemma2": (
        tf.Gemma2Config,
        dict(head_dim=8, query_pre_attn_scalar=4, sliding_window=WINDOW),
        "eager",
        dict(
            softcap=dict(attn_logit_softcapping=None),
            sliding_window=dict(sliding_window=10_000),
            scaling=dict(query_pre_attn_scalar=8),  # 1/sqrt(head_dim): ring's default
        ),
    ),
    "mistral": (
        tf.MistralConfig,
        dict(sliding_window=WINDOW),
        "sdpa",
        dict(sliding_window=dict(sliding_window=None)),
    ),
    "granite_swa": (
        tf.GraniteSWAConfig,
        dict(sliding_window=WINDOW, attention_multiplier=0.5),
        "eager",
        dict(
            s_aux=dict(sinks=NO_SINK),
            sliding_window=dict(sliding_window=10_000),
            scaling=dict(attention_multiplier=8**-0.5),
        ),
    ),
}
# weights 10x HF's default: scores large enough for the soft cap to bite
FAMILIES["gemma2"][1].update(
    attn_logit_softcapping=0.5, final_logit_softcapping=2.0, initializer_range=0.2
)
# float64 on both sides, ring attention only reorders sums; the eager softmax of Gemma2 and
# Granite SWA (and Gemma2's norms) run in float32 (dtype=torch.float32, weight.float()), so
# there the one-process reference itself carries float32 rounding (measured: losses 2e-8 and
# 6e-10 relative, gradients 2e-8 and 4e-9)
TOL = {"gemma2": 1e-7, "mistral": 1e-10, "granite_swa": 1e-8}
FLOAT32_GRAD = dict(rtol=1e-5, atol=1e-7)
GRAD_TOL = {"gemma2": FLOAT32_GRAD, "granite_swa": FLOAT32_GRAD}
# AdamW divides by sqrt(v) + 1e-8: float32 rounding of a near-zero gradient moves a weight by
# far more than the rounding (measured 7e-6 after 3 steps); a dropped argument moves every
# weight by about lr (1e-2)
FLOAT32_WEIGHT = dict(rtol=1e-4, atol=1e-4)
WEIGHT_TOL = {"gemma2": FLOAT32_WEIGHT, "granite_swa": FLOAT32_WEIGHT}


def build(name: str, sinks: float | None = None, **changes):
    """The seeded tiny model in float64; ``sinks``: every attention sink set to that logit."""
    cls, config, attn, _ = FAMILIES[name]
    config = cls(**{**SMALL, **config, **changes})
    model = seeded(lambda: tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn))
    if sinks is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(sinks)
    return model


def pairs() -> list:
    return [(dict(input_ids=x, attention_mask=m), y) for x, m, y in hf_batches(STEPS)]


def _positions(engine, outputs) -> int:
    return outputs[0].logits.shape[1]  # the positions this rank computed


def _train(ctx, name: str):
    model = build(name)
    run = engine_run(ctx, lambda: model, pairs(), lm_loss, adamw, watch=_positions)
    return run, model.config._attn_implementation


def _sequence(variant: str = "standard") -> dict:
    return dict(parallel=dict(tensor=dict(size=2, mode="sequence", ring_attention=variant)))


def _relative(losses, want: Tensor) -> float:
    return ((torch.tensor(losses, dtype=torch.float64) - want).abs() / want).max().item()


@pytest.mark.parametrize("case", ["gemma2", "gemma2-online", "mistral", "granite_swa"])
def test_ring_attention_computes_what_the_models_attention_asks(case):
    name, _, variant = case.partition("-")
    ref = reference_run(lambda: build(name), pairs(), dense_loss, adamw)
    want = torch.tensor(ref.losses, dtype=torch.float64)
    results = run_distributed(_train, 2, name, config=_sequence(variant or "standard"))
    err = _relative(global_losses([run for run, _ in results]), want)
    print(f"\nSEQUENCE {case}: loss error {err:.1e} (relative)")
    assert err <= TOL[name], (case, err)
    if not variant:  # each argument changes this model's losses: dropping it is not equal
        for arg, drop in FAMILIES[name][3].items():
            dropped = reference_run(lambda d=drop: build(name, **d), pairs(), dense_loss, adamw)
            gap = _relative(dropped.losses, want)
            print(f"  without {arg}: {gap:.1e}")
            assert gap > 100 * TOL[name], f"{case}: {arg} does not matter here ({gap})"
    for rank, (run, attn) in enumerate(results):
        tag = f"{case} rank {rank}"
        assert attn == "gridtrain_ring", (tag, attn)
        assert run.watched == [SEQ // 2] * STEPS, (tag, run.watched)  # only its half
        assert run.grads[0].keys() == ref.grads[0].keys() and run.state.keys() == ref.state.keys()
        for k, g in run.grads[0].items():
            tol = GRAD_TOL.get(name, dict(rtol=1e-8, atol=1e-10))
            torch.testing.assert_close(g, ref.grads[0][k], msg=f"{tag} grad {k}", **tol)
        for k, v in ref.state.items():
            tol = WEIGHT_TOL.get(name, dict(rtol=1e-4, atol=1e-7))
            torch.testing.assert_close(run.state[k], v, msg=f"{tag} {k}", **tol)
    grad_err = max((g - ref.grads[0][k]).abs().max().item() for k, g in run.grads[0].items())
    weight_err = max((run.state[k] - v).abs().max().item() for k, v in ref.state.items())
    print(f"  max |grad err| {grad_err:.1e}, max |weight err| after {STEPS} steps {weight_err:.1e}")


# ---- refusals --------------------------------------------------------------------------------
class BiasedLlamaAttention(LlamaAttention):
    """Hands its attention function a bias (as T5's or ALiBi's attention do)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, position_bias=torch.zeros(()), **kwargs)


def _refused_model(what: str):
    if what == "mask_pattern":  # its layers see every key of a window on both sides
        config = tf.Gemma3TextConfig(
            **SMALL, head_dim=8, sliding_window=WINDOW, use_bidirectional_attention=True
        )
        return seeded(lambda: tf.Gemma3ForCausalLM(config))
    model = build("mistral")
    if what == "bias":
        for layer in model.model.layers:
            layer.self_attn.__class__ = BiasedLlamaAttention
    return model


def _refused_batch(what: str, x: dict) -> dict:
    ids = x["input_ids"]
    if what == "output_attentions":
        return dict(x, output_attentions=True)
    if what == "packed":  # two sequences of 8 in each row: a restart at the shard boundary
        return dict(input_ids=ids, position_ids=torch.arange(SEQ).remainder(8).expand_as(ids))
    return x


def _refusal(ctx, what: str):
    model = _refused_model(what)
    try:
        engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    except gt.PlanError as err:
        return "initialize", str(err)
    x, _ = pairs()[0]
    try:
        engine(**_refused_batch(what, x))
    except gt.PlanError as err:
        return "forward", str(err)
    return None, None


@pytest.mark.parametrize(
    "what, when, words",
    [
        ("bias", "initialize", ["position_bias=a tensor", "BiasedLlamaAttention"]),
        ("mask_pattern", "initialize", ["gemma3_text", "mask pattern", "or_mask"]),
        ("output_attentions", "forward", ["MistralForCausalLM", "output_attentions"]),
        ("packed", "forward", ["packed sequences", "position_ids restart"]),
    ],
)
def test_what_ring_attention_does_not_compute_is_refused_by_name(what, when, words):
    for got, message in run_distributed(_refusal, 2, what, config=_sequence()):
        assert got == when, (got, message)
        for w in words:
            assert w in message, message
