"""The planner for any Hugging Face family, one defect of issue 32 each (all failed before):

* a config ``parallel.tensor.plan`` overrides the model's ``_tp_plan`` entry by entry, so an
  entry whose style gridtrain does not implement can be replaced (it is refused by name
  where it would apply);
* models without a ``_tp_plan`` (BERT as a causal LM, OPT: separate q, k, v) get the traced
  plan under 1d and 2d, equal to one process, and nobody blames "fused projections";
* BERT's ``cls.predictions.bias``, tied by HF to its decoder's bias outside the replaced
  layer, follows the replacement: ``gt.full_state_dict`` carries the trained value;
* the sharded-shape dry run runs for HF models: a plan whose local shapes break the model's
  forward is a ``gt.PlanError`` at ``initialize`` naming the module, before any weight moves;
* a fused projection the trace cannot follow is refused naming it under 2d;
* Qwen3's ``replicated_with_grad_allreduce`` (its per-head norms) is understood, and norms
  are recognised by what they compute (Cohere's ``CohereLayerNorm`` under 2d).

Equality: the global losses of two SGD steps, the first step's gradients and the trained
weights against the same model in one plain process (float64; ``TOL``), each rank holding
only its share.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_zoo
from helpers.harness import run_distributed
from helpers.runs import (
    data_rows,
    engine_step,
    global_losses,
    local_numel,
    reference_run,
    start_engine,
    stepped_grads,
)
from test_hf_sweep import batches, dense_loss, lm_loss, sgd
from torch import nn

import gridtrain as gt

TOL = dict(rtol=1e-6, atol=1e-8)  # float64: summation order only; norms rounding inside to
# float32 do so in both runs alike. A stale weight is off by a whole SGD step.
TP = lambda size, mode, **kw: dict(parallel=dict(tensor=dict(size=size, mode=mode, **kw)))  # noqa: E731


def _bert():
    """BERT as a causal LM (``is_decoder=True``), tiny; its head is tied to the embedding and
    its ``cls.predictions.bias`` to the decoder's bias."""
    import transformers as tf

    cfg = tf.BertConfig(
        vocab_size=hf_zoo.VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return tf.BertLMHeadModel(cfg).double()


def _build(name: str, plan: dict | None = None):
    model = _bert() if name == "bert" else hf_zoo.build(name)
    if plan is not None:  # the family's own _tp_plan, changed
        model._tp_plan = plan
    return model


def _train(ctx, name: str, plan: dict | None):
    model = _build(name, plan)
    dense = sum(p.numel() for p in model.parameters())
    engine, _ = start_engine(model, lm_loss, sgd)
    losses, grads = [], None
    for step, batch in enumerate(batches()):
        losses.append(engine_step(engine, *data_rows(batch, ctx), ctx))
        if step == 0:
            grads = stepped_grads(
                None, gt.full_optimizer_state_dict(engine.model, engine.optimizer)
            )
    held = sum(local_numel(p) for p in engine.model.parameters()) / dense
    return dict(
        losses=losses,
        grads=grads,
        state=gt.full_state_dict(engine.model),
        held=held,
        plan=str(engine.plan),
    )


def assert_equal(name: str, world: int, config: dict, plan: dict | None = None) -> dict:
    """Train ``name`` in ``config`` and in one process; assert equality; rank 0's results."""
    ref = reference_run(lambda: _build(name, plan), batches(), dense_loss, sgd)
    cells = run_distributed(_train, world, name, plan, config=config, timeout=300)
    torch.testing.assert_close(global_losses([c["losses"] for c in cells]), ref.losses, **TOL)
    rank0 = cells[0]
    assert set(rank0["state"]) == set(ref.state)
    for key, value in ref.state.items():
        torch.testing.assert_close(rank0["state"][key], value, **TOL, msg=key)
    for key, g in ref.grads[0].items():
        torch.testing.assert_close(rank0["grads"][key], g, **TOL, msg=f"grad {key}")
    for c in cells:  # really sharded: a replica holds 1.0
        assert c["held"] <= 0.8, c["held"]
    return rank0


def _refusal(ctx, name: str, plan: dict | None):
    model = _build(name, plan)
    try:
        gt.initialize(model, sgd(model), lm_loss)
    except gt.PlanError as err:
        return str(err), [tuple(p.shape) for p in model.parameters()]
    return None, None


def assert_refused(name: str, world: int, config: dict, words, plan: dict | None = None):
    """``initialize`` raises a PlanError holding ``words`` on every rank, no weight moved."""
    dense = [tuple(p.shape) for p in _build(name, plan).parameters()]
    for message, shapes in run_distributed(_refusal, world, name, plan, config=config):
        assert message is not None, f"{name}: initialize did not refuse"
        for w in words:
            assert w in message, message
        assert "fused projections" not in message, message
        assert shapes == dense, "a weight moved before the refusal"


def _llama_plan_with(style: str) -> dict:
    import transformers as tf

    plan = dict(tf.LlamaForCausalLM(hf_zoo.tiny_config("llama"))._tp_plan)
    plan["model.layers.*.mlp.down_proj"] = style
    return plan


def test_a_config_plan_overrides_the_model_plan_entry_by_entry():
    """The model's plan names a style gridtrain does not implement for ``down_proj``: refused
    naming the module and the style; the config's entry for ``down_proj`` replaces it, and the
    rest of the model's plan still applies."""
    plan = _llama_plan_with("all_reduce")
    words = ["'model.layers.0.mlp.down_proj'", "'all_reduce'", "parallel.tensor.plan"]
    assert_refused("llama", 2, TP(2, "1d"), words, plan)
    config = TP(2, "1d", plan={"model.layers.*.mlp.down_proj": "rowwise"})
    rank0 = assert_equal("llama", 2, config, plan)
    rows = {line.split()[0]: line for line in rank0["plan"].splitlines()[2:]}
    assert "config" in rows["model.layers.0.mlp.down_proj"]
    assert "model plan" in rows["model.layers.0.mlp.up_proj"]


@pytest.mark.parametrize("world, config", [(2, TP(2, "1d")), (4, TP(4, "2d"))])
def test_bert_without_a_plan_is_traced_and_its_tied_bias_follows(world, config):
    """BERT has no _tp_plan: the trace plans it (separate q, k, v); ``cls.predictions.bias``
    (tied by HF to ``cls.predictions.decoder.bias``) comes back trained."""
    assert_equal("bert", world, config)


def test_bert_with_an_explicit_plan_keeps_its_tied_bias():
    """The plan the old refusal asked for, every Linear named: the tied bias stayed stale."""
    plan = {
        "bert.encoder.layer.*.attention.self.query": "colwise",
        "bert.encoder.layer.*.attention.self.key": "colwise",
        "bert.encoder.layer.*.attention.self.value": "colwise",
        "bert.encoder.layer.*.attention.output.dense": "rowwise",
        "bert.encoder.layer.*.intermediate.dense": "colwise",
        "bert.encoder.layer.*.output.dense": "rowwise",
        "cls.predictions.transform.dense": "replicate",
        "cls.predictions.decoder": "colwise_gather_output",
    }
    assert_equal("bert", 2, TP(2, "1d", plan=plan))


def test_opt_without_a_plan_trains_under_2d():
    assert_equal("opt", 4, TP(4, "2d"))


def test_a_plan_breaking_the_local_shapes_is_refused_at_initialize_by_module():
    """OLMo2's q_norm normalises all of q: a config that gathers q_proj's output under 2d
    hands the grid's norm a whole row; the dry run names the norm before any weight moves."""
    config = TP(4, "2d", plan={"model.layers.*.self_attn.q_proj": "gather_output"})
    assert_refused("olmo2", 4, config, ["'model.layers.0.self_attn.q_norm'", "2d"])


class FusedEinsum(nn.Module):
    """A causal LM whose one ``qkv`` Linear feeds q, k and v through ``einsum`` (no cut the
    trace follows)."""

    def __init__(self, vocab=hf_zoo.VOCAB, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.qkv, self.out = nn.Embedding(vocab, d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        b, s, _ = x.shape
        pick = torch.eye(3, dtype=x.dtype, device=x.device)
        qkv = self.qkv(x).view(b, s, self.heads, 3, -1)
        q, k, v = (torch.einsum("bshtd,t->bhsd", qkv, pick[i]) for i in range(3))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(a.transpose(1, 2).reshape(b, s, -1)))


def _fused_refusal(ctx):
    model = FusedEinsum().double()
    try:
        gt.initialize(model, sgd(model), lm_loss, example_inputs=torch.zeros(2, 8).long())
    except gt.PlanError as err:
        return str(err)
    return None


def test_a_fused_projection_the_trace_cannot_follow_is_refused_by_name():
    """Under 2d every Linear is split by columns (1d gathers such an output instead)."""
    for message in run_distributed(_fused_refusal, 4, config=TP(4, "2d")):
        assert message is not None and "'qkv'" in message and "fused" in message, message


def test_qwen3_plan_with_replicated_with_grad_allreduce_is_sharded_under_1d():
    """Qwen3's own ``_tp_plan`` gives its per-head ``q_norm`` / ``k_norm``
    ``replicated_with_grad_allreduce``; the model is sharded by that plan, not refused."""
    rank0 = assert_equal("qwen3", 2, TP(2, "1d"))
    rows = {line.split()[0]: line for line in rank0["plan"].splitlines()[2:]}
    assert "replicated_with_grad_allreduce" in rows["model.layers.0.self_attn.q_norm"]


def test_cohere_layernorm_is_recognised_under_2d():
    """``CohereLayerNorm`` (a LayerNorm without bias, computed in float32, no "LayerNorm"
    base class) is the grid's norm under 2d, equal to one process."""
    assert_equal("cohere", 4, TP(4, "2d"))
