"""A plain model's ``F.scaled_dot_product_attention`` under sequence parallelism trains as one
process does: the engine runs it as ring attention over the sequence group, with no change to
the model's code.

The model is plain PyTorch in float64: a causal block with grouped-query attention
(``enable_gqa=True``) and its own ``scale=``, and a bidirectional block whose ``attn_mask``
masks padding keys (``[B, 1, 1, s]``, from the token ids). Each rank must see only its
block of positions (``seen``), so an unsplit run fails, and attention confined to that
block gives other losses (the first loss is off by ~1e-2). Calls ring attention cannot
honour fail in ``gt.initialize`` naming the module and the argument, or at the first
forward where no input could be built for the planner's dry run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.runs import engine_run, reference_run, seeded, token_batches
from torch import nn

import gridtrain as gt

VOCAB, D, HEADS, KV_HEADS, SEQ, BATCH, STEPS, PAD = 32, 16, 4, 2, 8, 4, 3, 0


class Block(nn.Module):
    """Pre-norm attention and MLP; ``causal`` blocks use GQA and a scale of their own,
    the others mask padding keys."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal, self.head_dim = causal, D // HEADS
        kv = KV_HEADS * self.head_dim if causal else D
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(D, kv), nn.Linear(D, kv)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.seen: list[int] = []  # positions per forward: this rank's block of the sequence

    def forward(self, x, keep):
        b, s, _ = x.shape
        if not x.is_meta:  # the planner's runs on meta see the example's shapes
            self.seen.append(s)
        h = self.ln1(x)
        q, k, v = (
            t(h).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        if self.causal:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + self.o(a.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(causal=True), Block(causal=False)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, ids):
        x, keep = self.emb(ids), ids != PAD
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.norm(x))


def _build() -> LM:
    return seeded(LM)


def _sgd(model):  # SGD: the weights carry the gradients' rounding, not AdamW's amplification
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)


def _loss(logits, labels):
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _batches():
    out = token_batches(STEPS, BATCH, SEQ, VOCAB)
    for ids, _ in out:
        ids[ids == PAD] = 1
        ids[1, -3:] = PAD  # right padding in one row: masked keys
    return out


def _seen(engine):
    """Positions each block saw per forward, and the graphs dynamo compiled."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {s for block in engine.model.blocks for s in block.seen}, graphs


def _train(ctx, batches):
    torch._dynamo.reset()  # a pooled worker may hold another test's graphs
    torch._dynamo.utils.counters.clear()
    return engine_run(ctx, _build, batches, _loss, _sgd, probe=_seen)


LAYOUTS = {
    # name: (world size, config); sequence2 also recomputes each block in the backward
    "sequence2": (
        2,
        dict(parallel=dict(tensor=dict(size=2, mode="sequence")), activation_checkpoint=dict()),
    ),
    "sequence4": (4, dict(parallel=dict(tensor=dict(size=4, mode="sequence")))),
    # each block compiled (dynamo traces through the routing mode; ring attention's p2p
    # breaks the graph): the "eager" backend runs what dynamo captured, cheap enough for CI
    "sequence2 compiled": (
        2,
        dict(parallel=dict(tensor=dict(size=2, mode="sequence")), compile=dict(backend="eager")),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plain_sdpa_model_equals_one_process(name):
    world, config = LAYOUTS[name]
    batches = _batches()
    ref = reference_run(_build, batches, _loss, _sgd)
    for rank, run in enumerate(run_distributed(_train, world, batches, config=config)):
        seen, graphs = run.probed
        assert seen == {SEQ // world}, (name, rank, seen)  # its block of positions only
        assert (graphs > 0) == ("compile" in config), (name, graphs)
        # float64: ring attention only reorders the softmax sums, ~1e-15 relative
        assert run.losses == pytest.approx(ref.losses, rel=1e-10), (name, rank, run.losses)
        for key, grad in ref.grads[0].items():  # summed over the sequence group, then averaged
            torch.testing.assert_close(run.grads[0][key], grad, rtol=0, atol=1e-12, msg=key)
        for key, value in ref.state.items():
            # 3 SGD steps carry the gradients' float64 rounding: 1e-10 absolute
            torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-10, msg=key)


class _Refused(nn.Module):
    """One attention call that ring attention cannot honour, as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.emb, self.head = kind, nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True) if kind == "mha" else None

    def forward(self, ids, extra=None):
        x = self.emb(ids)
        if self.mha is not None:
            return self.head(self.mha(x, x, x)[0])
        q = x.view(*x.shape[:2], 2, D // 2).transpose(1, 2)
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()  # a causal mask by hand
        a = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return self.head(a.transpose(1, 2).reshape(x.shape))


def _refusals(ctx):
    """The error of each refused call: from gt.initialize, or from the first forward where
    ``extra`` (a second input) leaves the dry run no example to run."""
    out = {}
    for kind in ("mask", "mha"):
        model = _Refused(kind).double()
        try:
            gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
        except ValueError as err:  # gridtrain's PlanError is a ValueError
            out[kind] = str(err)
    model = _Refused("mask").double()
    model.forward = lambda ids, extra: _Refused.forward(model, ids, extra)  # two inputs
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss)
    try:
        engine(torch.ones(2, SEQ, dtype=torch.long), torch.ones(2, SEQ))
    except ValueError as err:
        out["first forward"] = str(err)
    return out


def test_calls_ring_attention_cannot_honour_are_refused_by_name():
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")))
    for errors in run_distributed(_refusals, 2, config=config):
        assert errors.keys() == {"mask", "mha", "first forward"}, errors
        assert errors["mask"].startswith("'_Refused' under tensor mode 'sequence'"), errors["mask"]
        for kind in ("mask", "first forward"):
            assert "attn_mask of shape (4, 4)" in errors[kind], errors[kind]
            assert "gt.nn.attention" in errors[kind] and "is_causal=True" in errors[kind]
        # nn.MultiheadAttention runs as ring attention (test_mha_parallel), but not its
        # default need_weights=True: the probabilities are never whole on one rank
        mha = "'mha': nn.MultiheadAttention under tensor mode 'sequence': need_weights=True"
        assert errors["mha"].startswith(mha), errors["mha"]
