"""1D tensor parallelism equals its dense twin: every layer, the vocab-parallel loss, dropout's
RNG, and a transformer block trained with AdamW, at tensor-parallel sizes 2 and 4.

Each parity check builds the dense layer on the CPU from a seed, loads its state dict into
the 1d layer with ``load_full_state_dict``, and compares the output, the input gradient and
*each rank's* weight-gradient shard with the matching slice of the dense ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import gridtrain as gt
import gridtrain.nn as gnn
from gridtrain.parallel.pipeline.partition import _materialise
from gridtrain.parallel.sharding import (
    full_state_dict,
    full_tensor,
    get_shard_spec,
    load_full_state_dict,
    shard_tensor,
)
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor import mode_1d as m1d

PM = gt.ParallelMode
CLASS_SPLIT = ((1, PM.PARALLEL_1D),)  # [tokens, classes] logits split over the classes


def _cfg(tp: int) -> dict:
    return dict(parallel=dict(tensor=dict(size=tp, mode="1d")))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- single layers ----------------------------------------------------------------------
# (name, dense twin factory, 1d factory, input factory, input is sharded, output is sharded)
def _layer_cases():
    ids = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))
    ids[0, :3] = torch.tensor([1, 3, 15])  # padding rows and the last vocabulary row
    return [
        ("Linear1DCol", lambda: nn.Linear(8, 16), lambda c: m1d.Linear1DCol(8, 16, ctx=c),
         lambda: _randn(2, 3, 5, 8), False, True),
        ("Linear1DCol(gather_output)", lambda: nn.Linear(8, 16),
         lambda c: m1d.Linear1DCol(8, 16, gather_output=True, ctx=c),
         lambda: _randn(3, 3, 5, 8), False, False),
        ("Linear1DRow", lambda: nn.Linear(16, 8), lambda c: m1d.Linear1DRow(16, 8, ctx=c),
         lambda: _randn(4, 3, 5, 16), True, False),
        ("Linear1DRow(replicated input)", lambda: nn.Linear(16, 8, bias=False),
         lambda c: m1d.Linear1DRow(16, 8, bias=False, parallel_input=False, ctx=c),
         lambda: _randn(5, 3, 5, 16), False, False),
        ("Embedding1D", lambda: nn.Embedding(16, 8, padding_idx=1),
         lambda c: m1d.Embedding1D(16, 8, padding_idx=1, ctx=c), lambda: ids, False, False),
        ("VocabParallelEmbedding1D", lambda: nn.Embedding(16, 8, padding_idx=3),
         lambda c: m1d.VocabParallelEmbedding1D(16, 8, padding_idx=3, ctx=c),
         lambda: ids, False, False),
        ("Classifier1D", lambda: dense.Classifier(8, 12),
         lambda c: m1d.Classifier1D(8, 12, ctx=c), lambda: _randn(6, 3, 5, 8), False, False),
        ("VocabParallelClassifier1D", lambda: dense.Classifier(8, 16),
         lambda c: m1d.VocabParallelClassifier1D(8, 16, ctx=c),
         lambda: _randn(7, 3, 5, 8), False, True),
        ("PatchEmbedding1D", lambda: dense.PatchEmbedding(8, 4, 3, 16),
         lambda c: m1d.PatchEmbedding1D(8, 4, 3, 16, ctx=c),
         lambda: _randn(8, 2, 3, 8, 8), False, False),
        ("LayerNorm", lambda: nn.LayerNorm(8), lambda c: m1d.LayerNorm(8, ctx=c),
         lambda: _randn(9, 3, 5, 8), False, False),
    ]  # fmt: skip


def _shard(t: torch.Tensor, sharded: bool, ctx) -> torch.Tensor:
    return shard_tensor(t, ((t.dim() - 1, PM.PARALLEL_1D),), ctx) if sharded else t


def _layer_parity(ctx) -> dict[str, dict[str, float]]:
    out = {}
    for k, (name, make_dense, make_1d, make_x, x_sharded, y_sharded) in enumerate(_layer_cases()):
        torch.manual_seed(100 + k)
        ref = make_dense()
        torch.manual_seed(100 + k)
        layer = make_1d(ctx)
        init = full_state_dict(layer, ctx)  # same seed: the dense draw, cut and re-gathered
        errs = {"init": max(_max_err(init[n], t) for n, t in ref.state_dict().items())}
        assert init.keys() == ref.state_dict().keys(), (name, init.keys())
        with torch.no_grad():  # nonzero LayerNorm/classifier biases so their path is checked
            for p in ref.parameters():
                p.add_(0.1 * _randn(k, *p.shape))
        load_full_state_dict(layer, ref.state_dict(), ctx)

        x = make_x()
        xd = x.clone().requires_grad_(x.is_floating_point())
        yd = ref(xd)
        w = _randn(50 + k, *yd.shape)
        (yd * w).sum().backward()

        xl = _shard(x, x_sharded, ctx).clone().requires_grad_(x.is_floating_point())
        y = layer(xl)
        (y * _shard(w, y_sharded, ctx)).sum().backward()  # every rank's part of <y, w>
        errs["output"] = _max_err(y, _shard(yd, y_sharded, ctx))
        if x.is_floating_point():
            errs["input grad"] = _max_err(xl.grad, _shard(xd.grad, x_sharded, ctx))
        dense_params = dict(ref.named_parameters())
        for pname, p in layer.named_parameters():
            want = shard_tensor(dense_params[pname].grad, get_shard_spec(p), ctx)
            errs[f"{pname} grad"] = _max_err(p.grad, want)
        out[name] = errs
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_every_layer_equals_dense_twin(tp):
    results = run_distributed(_layer_parity, tp, config=_cfg(tp), timeout=300)
    assert set(results[0]) == {c[0] for c in _layer_cases()}
    for rank, per_layer in enumerate(results):
        for name, errs in per_layer.items():
            # init: shards of the same seeded dense draw, gathered back: bit-identical
            assert errs.pop("init") == 0.0, (rank, name)
            for what, err in errs.items():
                # float32; split matmuls / all-reduces only reorder sums of <= 48 O(1) terms,
                # a few ulps of the O(10) outputs (measured <= ~1e-6)
                assert err < 1e-5, f"TP{tp} rank {rank} {name} {what}: {err}"


# ---- vocab-parallel cross entropy and accuracy --------------------------------------------
def _loss_parity(ctx) -> dict[str, float]:
    V, N = 16, 12
    full = _randn(11, N, V) * 3
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(12))
    labels[[2, 7]] = -100  # ignored
    errs = {}
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            key = f"{reduction}, smoothing {smoothing}"
            xd = full.clone().requires_grad_()
            ld = F.cross_entropy(xd, labels, reduction=reduction, label_smoothing=smoothing)
            ld.backward(torch.ones_like(ld))
            xl = shard_tensor(full, CLASS_SPLIT, ctx).requires_grad_()
            loss_fn = m1d.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing)
            ll = loss_fn(m1d.mark_vocab_sharded(xl), labels)
            ll.backward(torch.ones_like(ll))
            errs[f"loss ({key})"] = _max_err(ll, ld) / max(1.0, ld.abs().max().item())
            errs[f"grad ({key})"] = _max_err(xl.grad, shard_tensor(xd.grad, CLASS_SPLIT, ctx))
    # bf16 logits: computed in float32 inside, so equal to F.cross_entropy of the same values
    xb = full.to(torch.bfloat16)
    lb = m1d.CrossEntropyLoss()(m1d.mark_vocab_sharded(shard_tensor(xb, CLASS_SPLIT, ctx)), labels)
    errs["loss (bf16 logits)"] = _max_err(lb, F.cross_entropy(xb.float(), labels))
    # gathered logits take the plain path
    errs["loss (gathered logits)"] = _max_err(
        m1d.CrossEntropyLoss()(full, labels), F.cross_entropy(full, labels)
    )
    # accuracy: integer logits make many ties across ranks; argmax takes the first index
    ties = torch.randint(0, 3, (64, V), generator=torch.Generator().manual_seed(13)).float()
    lab = torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(14))
    correct, total = m1d.accuracy(
        m1d.mark_vocab_sharded(shard_tensor(ties, CLASS_SPLIT, ctx)), lab, ctx
    )
    want, want_total = dense.accuracy(ties, lab)
    errs["accuracy"] = float(correct.item() != want.item() or total.item() != want_total.item())
    return errs


def _bad_inputs(ctx) -> int:
    """Misuse fails on every rank with a message naming the value, before any collective."""
    checks = [
        (lambda: m1d.Linear1DCol(8, 6, ctx=ctx) if ctx.world_size(PM.PARALLEL_1D) == 4 else m1d.Linear1DCol(8, 5, ctx=ctx),
         r"out_features=\d is not divisible by the 1d tensor-parallel size"),
        (lambda: m1d.Linear1DRow(16, 8, ctx=ctx)(torch.zeros(2, 16)),
         r"wants a sharded input \(in_features / n\) of width \d, got input of shape \(2, 16\)"),
        (lambda: m1d.VocabParallelClassifier1D(8, 16, weight=nn.Parameter(torch.zeros(16, 8)), ctx=ctx),
         r"tied VocabParallelClassifier weight must be this rank's shard"),
        (lambda: m1d.vocab_parallel_cross_entropy(
            m1d.mark_vocab_sharded(torch.zeros(3, 4)), torch.tensor([0, 99, -100]), ctx),
         r"labels must be in \[0, \d+\) or ignore_index=-100, got \[99\]"),
        (lambda: m1d.Linear(8, 8, gather_output=True, parallel_input=True, ctx=ctx),
         r"gather_output \(column-parallel\) and parallel_input \(row-parallel\) exclude"),
    ]  # fmt: skip
    for fn, pattern in checks:
        with pytest.raises(ValueError, match=pattern):
            fn()
    return len(checks)


def _loss_and_errors(ctx):
    return _loss_parity(ctx), _bad_inputs(ctx)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_equals_dense(tp):
    for rank, (errs, n_checked) in enumerate(
        run_distributed(_loss_and_errors, tp, config=_cfg(tp), timeout=300)
    ):
        assert n_checked == 5
        assert errs.pop("accuracy") == 0.0, rank
        for what, err in errs.items():
            # float32 logsumexp from per-rank partial sums: reordered sums of 16 exp terms,
            # a few ulps (losses compared relative to max(1, |loss|), the sum reduction is
            # O(30)); bf16 logits are upcast exactly inside, so the same bound holds
            assert err < 2e-6, f"TP{tp} rank {rank} {what}: {err}"


# ---- dropout draws from the right RNG state ----------------------------------------------
P_DROP, DROP_SHAPE = 0.3, (128, 128)


def _dropout_masks(ctx):
    x = torch.ones(DROP_SHAPE)
    replicated = m1d.Dropout1D(P_DROP, sharded=False, ctx=ctx)
    sharded = m1d.Dropout1D(P_DROP, sharded=True, ctx=ctx)
    before = torch.get_rng_state()
    y_sharded = sharded(x)
    after_sharded = torch.rand(8)
    torch.set_rng_state(before)
    default_untouched = torch.equal(after_sharded, torch.rand(8))
    torch.set_rng_state(before)
    y_replicated = replicated(x)
    sharded.eval()
    eval_identity = torch.equal(sharded(x), x)
    # gt.nn.Dropout decides by where it is built: between a column and its row layer = sharded
    m1d.reset_alternation(ctx)
    gnn.Linear(8, 16)
    mid = gnn.Dropout(P_DROP)
    gnn.Linear(16, 8)
    post = gnn.Dropout(P_DROP)
    with gnn.shared_input():
        for _ in range(3):  # q, k, v
            gnn.Linear(8, 8)
        attn = gnn.Dropout(P_DROP)
    gnn.Linear(8, 8)
    resid = gnn.Dropout(P_DROP)
    flags = (mid.sharded, post.sharded, attn.sharded, resid.sharded)
    return y_sharded, y_replicated, default_untouched, eval_identity, flags


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_masks_follow_activation_layout(tp):
    results = run_distributed(_dropout_masks, tp, config=_cfg(tp), timeout=300)
    n = DROP_SHAPE[0] * DROP_SHAPE[1]
    sigma = ((1 - P_DROP) * P_DROP / n) ** 0.5
    for y_sh, y_rep, untouched, eval_identity, flags in results:
        assert untouched, "the sharded state is forked: the default generator does not advance"
        assert eval_identity
        assert flags == (True, False, True, False), flags
        assert torch.equal(y_rep, results[0][1]), "replicated activations: one mask everywhere"
        for y in (y_sh, y_rep):
            kept = y != 0
            # Bernoulli(0.7) over 16384 draws: 5 sigma (~0.018) never trips on a correct mask
            assert abs(kept.float().mean().item() - (1 - P_DROP)) < 5 * sigma
            # survivors are rescaled by 1/(1-p) (float32 rounding of that factor)
            torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - P_DROP)))
    for i in range(tp):
        for j in range(i + 1, tp):
            agree = ((results[i][0] != 0) == (results[j][0] != 0)).float().mean().item()
            # independent masks agree on p^2 + (1-p)^2 = 0.58 of the elements, equal ones on all
            assert abs(agree - 0.58) < 10 * sigma, f"sharded masks of ranks {i},{j} agree {agree}"


# ---- a transformer block trained with AdamW -------------------------------------------------
STEPS, LR = 3, 1e-2


class TinyTransformer(nn.Module):
    """Tied embedding/classifier around one pre-norm block: attention with separate q, k, v
    (built in ``gt.nn.shared_input()``) and a GELU MLP. Written once with ``gt.nn``."""

    def __init__(self, vocab_parallel: bool, vocab: int = 32, hidden: int = 16, head_dim: int = 4):
        super().__init__()
        emb = gnn.VocabParallelEmbedding if vocab_parallel else gnn.Embedding
        cls = gnn.VocabParallelClassifier if vocab_parallel else gnn.Classifier
        self.head_dim = head_dim
        self.emb = emb(vocab, hidden)
        self.ln1 = gnn.LayerNorm(hidden)
        with gnn.shared_input():
            self.q = gnn.Linear(hidden, hidden)
            self.k = gnn.Linear(hidden, hidden)
            self.v = gnn.Linear(hidden, hidden)
        self.o = gnn.Linear(hidden, hidden)
        self.ln2 = gnn.LayerNorm(hidden)
        self.fc1 = gnn.Linear(hidden, 2 * hidden)
        self.fc2 = gnn.Linear(2 * hidden, hidden)
        self.lnf = gnn.LayerNorm(hidden)
        self.head = cls(hidden, vocab, weight=self.emb.weight)

    def forward(self, ids):
        x = self.emb(ids)
        h = self.ln1(x)
        b, s, _ = h.shape

        def heads(t):  # local heads: the width tells how many this rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(
            heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(self.lnf(x))


def _batches():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(0, 32, (4, 9), generator=g) for _ in range(STEPS)]


def _train(model, batches, grads_of):
    """AdamW steps of next-token CE through ``gt.nn.CrossEntropyLoss`` on flattened logits
    (so a vocab-sharded mark must survive ``flatten``); returns losses and first grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loss_fn = gnn.CrossEntropyLoss()
    losses, grads = [], None
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(model(b[:, :-1]).flatten(0, -2), b[:, 1:].flatten())
        loss.backward()
        grads = grads or grads_of(model)
        opt.step()
        losses.append(loss.item())
    return losses, grads


class _DefaultDtype:
    def __init__(self, dtype):
        self.dtype, self.saved = dtype, torch.get_default_dtype()

    def __enter__(self):
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)


VARIANTS = [(vp, dt) for vp in (True, False) for dt in (torch.float64, torch.float32)]


def _train_1d(ctx, states, batches):
    out = []
    for (vp, dtype), state in zip(VARIANTS, states, strict=True):
        with _DefaultDtype(dtype):
            m1d.reset_alternation(ctx)
            torch.manual_seed(0)
            model = TinyTransformer(vp)
            kinds = [type(getattr(model, n)).__name__ for n in ("q", "k", "v", "o", "fc1", "fc2")]
            init = full_state_dict(model)
            load_full_state_dict(model, state)

            def full_grads(m):
                return {
                    k: full_tensor(p.grad, get_shard_spec(p), ctx) for k, p in m.named_parameters()
                }

            losses, grads = _train(model, batches, full_grads)
            out.append((kinds, init, losses, grads, full_state_dict(model), _lazy_init(ctx, vp)))
    return out


def _lazy_init(ctx, vp: bool) -> dict[str, torch.Tensor]:
    """Built under ``gt.lazy_init`` (meta), then allocated and reset as a pipeline stage is."""
    m1d.reset_alternation(ctx)
    with gt.lazy_init():
        model = TinyTransformer(vp)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    _materialise([model], ctx.device)
    return full_state_dict(model)


@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_equals_dense_after_adamw(tp):
    batches, dense_runs = _batches(), []
    for vp, dtype in VARIANTS:  # no context here: gt.nn builds the dense twin
        with _DefaultDtype(dtype):
            torch.manual_seed(0)
            model = TinyTransformer(vp)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            grads_of = lambda m: {k: p.grad.clone() for k, p in m.named_parameters()}  # noqa: E731
            losses, grads = _train(model, batches, grads_of)
            dense_runs.append((state, losses, grads, model.state_dict()))
    states = [r[0] for r in dense_runs]
    results = run_distributed(_train_1d, tp, states, batches, config=_cfg(tp), timeout=300)
    for rank, runs in enumerate(results):
        for (vp, dtype), (kinds, init, losses, grads, final, lazy), (
            state,
            d_losses,
            d_grads,
            d_final,
        ) in zip(VARIANTS, runs, dense_runs, strict=True):
            tag = f"TP{tp} rank {rank} vocab_parallel={vp} {dtype}"
            assert kinds == ["Linear1DCol"] * 3 + ["Linear1DRow", "Linear1DCol", "Linear1DRow"]
            assert init.keys() == state.keys()
            for k, v in state.items():
                assert torch.equal(init[k], v), (tag, k)  # same seed: same dense draw, cut
                # lazy_init: reset_parameters redraws the dense init in construction order
                assert torch.equal(lazy[k], v), (tag, "lazy", k)
            if dtype == torch.float64:
                # float64: split matmuls and all-reduces reorder sums, measured <= 5e-16 on
                # gradients and 1.4e-16 relative on losses
                assert losses == pytest.approx(d_losses, rel=1e-12, abs=0), tag
                for k, g in d_grads.items():
                    assert _max_err(grads[k], g) < 1e-12, (tag, k)
                # AdamW divides by sqrt(v) + eps (1e-8): on near-zero gradients a difference
                # dg moves a weight by up to lr * dg / eps = 1e-2 * 5e-16 / 1e-8 = 5e-10 per
                # step (measured <= 3e-11 after 3 steps); a wrong shard or reduction is O(lr)
                for k, v in d_final.items():
                    assert _max_err(final[k], v) < 2e-9, (tag, k)
            else:
                # float32: reordered sums of <= 32 terms, a few ulps of O(1) values. Weights
                # after AdamW are checked in float64 only: on near-zero grads (~1e-9, the
                # size of eps) Adam's g/sqrt(v) turns float32 rounding into ~lr-sized steps
                assert losses == pytest.approx(d_losses, rel=1e-5), tag
                for k, g in d_grads.items():
                    assert _max_err(grads[k], g) < 1e-6, (tag, k)
