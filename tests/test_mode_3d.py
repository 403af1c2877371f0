"""3D tensor parallelism on a 2x2x2 cube of gloo ranks, against dense twins.

Every layer is built dense and 3D from the same seed, both loaded with the same
perturbed full state dict; the 3D output, input gradient and every shard's
weight gradient are compared with the dense ones (float64: only the order of
sums differs, ~1e-15, so 1e-10 catches any wrong block, missing reduction or
double count by many orders of magnitude). Then a small model trained 3 AdamW
steps, checkpoints moved between 3D and the other layouts, and shard sizes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import gridtrain as gt
import gridtrain.nn as gnn
from gridtrain.parallel.sharding import (
    full_state_dict,
    full_tensor,
    get_shard_spec,
    load_full_state_dict,
    shard_tensor,
)
from gridtrain.parallel.tensor import dense, layers
from gridtrain.parallel.tensor import mode_3d as m3

PM = gt.ParallelMode
A, B, C = PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT
CUBE = dict(parallel=dict(tensor=dict(size=8, mode="3d")))
TOL = 1e-10  # float64 parity, see module docstring
TIMEOUT = 300
DT = torch.float64
BATCH, SEQ, HID = 8, 2, 8


def _act(orientation: int, ndim: int):
    """Shard spec of an activation: rows over A then G, hidden (last dim) over F."""
    feat, row = (B, C) if orientation == 0 else (C, B)
    return ((0, A), (0, row), (ndim - 1, feat))


ROWS = ((0, A), (0, C))  # split_batch's rows; replicated over B


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _parity(ctx, make_dense, make_3d, x, in_spec, out_spec, orientation=0, seed=0):
    """Max errors (output, input grad, each weight-shard grad) of a 3D layer vs its dense twin."""
    torch.manual_seed(seed)
    ref = make_dense()
    m3.reset_orientation(ctx)
    if orientation:
        m3.Linear(HID, HID, ctx=ctx)  # a Linear before it turns the orientation
    torch.manual_seed(seed)
    par = make_3d()
    errs = {}
    full = full_state_dict(par, ctx)
    # same seed, same weights: the 3D layer starts as its dense twin does
    errs["init"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.add_(_rand(*p.shape, seed=100 + i))
    load_full_state_dict(par, ref.state_dict(), ctx)
    sizes = {
        n: (p.numel(), dict(ref.named_parameters())[n].numel()) for n, p in par.named_parameters()
    }

    grad_x = x.is_floating_point()
    xd = x.clone().requires_grad_(grad_x)
    yd = ref(xd)
    upstream = _rand(*yd.shape, seed=7)
    (yd * upstream).sum().backward()
    xl = shard_tensor(x, in_spec, ctx).requires_grad_(grad_x)
    yl = par(xl)
    (yl * shard_tensor(upstream, out_spec, ctx)).sum().backward()
    errs["out"] = (full_tensor(yl, out_spec, ctx) - yd).abs().max().item()
    if grad_x:
        errs["grad_x"] = (full_tensor(xl.grad, in_spec, ctx) - xd.grad).abs().max().item()
    dense_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        want = shard_tensor(dense_params[name].grad, get_shard_spec(p), ctx)
        errs[f"grad_{name}"] = (p.grad - want).abs().max().item()
    return errs, sizes


def _layer_cases(ctx):
    x2, x3 = _rand(BATCH, HID, seed=1), _rand(BATCH, SEQ, HID, seed=2)
    ids = torch.randint(0, 16, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ids[0, 0] = 1  # the padding index appears
    img = _rand(BATCH, 3, 4, 4, seed=4)
    cases = {}
    for o in (0, 1):
        cases[f"linear_o{o}"] = (
            lambda: nn.Linear(HID, 2 * HID, dtype=DT),
            lambda: m3.Linear(HID, 2 * HID, dtype=DT, ctx=ctx),
            x3,
            _act(o, 3),
            _act(1 - o, 3),
            o,
        )
        cases[f"layernorm_o{o}"] = (
            lambda: nn.LayerNorm(HID, dtype=DT),
            lambda: m3.LayerNorm(HID, dtype=DT, ctx=ctx),
            x3,
            _act(o, 3),
            _act(o, 3),
            o,
        )
        cases[f"embedding_o{o}"] = (
            lambda: nn.Embedding(16, HID, padding_idx=1, dtype=DT),
            lambda: m3.Embedding(16, HID, padding_idx=1, dtype=DT, ctx=ctx),
            ids,
            ROWS,
            _act(o, 3),
            o,
        )
        cases[f"classifier_o{o}"] = (
            lambda: dense.Classifier(HID, 8, dtype=DT),
            lambda: m3.Classifier(HID, 8, dtype=DT, ctx=ctx),
            x2,
            _act(o, 2),
            ROWS,
            o,
        )
    cases["linear_full_width_input"] = (
        lambda: nn.Linear(HID, 2 * HID, dtype=DT),
        lambda: m3.Linear(HID, 2 * HID, dtype=DT, ctx=ctx),
        x2,
        ROWS,
        _act(1, 2),
        0,
    )
    cases["vocab_embedding"] = (
        lambda: nn.Embedding(16, HID, padding_idx=1, dtype=DT),
        lambda: m3.VocabParallelEmbedding(16, HID, padding_idx=1, dtype=DT, ctx=ctx),
        ids,
        ROWS,
        _act(0, 3),
        0,
    )
    cases["vocab_classifier"] = (
        lambda: dense.Classifier(HID, 16, dtype=DT),
        lambda: m3.VocabParallelClassifier(HID, 16, dtype=DT, ctx=ctx),
        x3,
        _act(0, 3),
        _act(1, 3),
        0,
    )
    cases["classifier_replicated_bias"] = (
        lambda: dense.Classifier(HID, 6, dtype=DT),
        lambda: m3.Classifier(HID, 6, dtype=DT, ctx=ctx),
        x2,
        _act(0, 2),
        ROWS,
        0,
    )
    cases["patch_embedding"] = (
        lambda: dense.PatchEmbedding(4, 2, 3, HID, dtype=DT),
        lambda: m3.PatchEmbedding(4, 2, 3, HID, dtype=DT, ctx=ctx),
        img,
        ROWS,
        _act(0, 3),
        0,
    )
    return cases


def _loss_parity(ctx):
    """Cross entropy and accuracy on gathered and vocab-parallel logits (with ignored labels)."""
    out = {}
    labels = torch.randint(0, 16, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    labels[1, 1] = -100
    for vocab in (False, True):
        logits = _rand(BATCH, SEQ, 16, seed=6)
        ref = logits.clone().requires_grad_()
        loss_d = F.cross_entropy(ref.reshape(-1, 16), labels.reshape(-1))
        loss_d.backward()
        spec = _act(1, 3) if vocab else ROWS
        local = shard_tensor(logits, spec, ctx).requires_grad_()
        if vocab:
            setattr(local, m3.VOCAB_PARALLEL_TAG, True)
        loss = m3.CrossEntropyLoss(ctx=ctx)(local, m3.split_batch(labels, ctx))
        loss.backward()
        correct, total = m3.accuracy(local.detach(), m3.split_batch(labels, ctx), ctx)
        valid = labels != -100
        want_correct = ((logits.argmax(-1) == labels) & valid).sum().item()
        key = "vocab" if vocab else "gathered"
        out[f"ce_{key}"] = abs(loss.item() - loss_d.item())
        out[f"ce_grad_{key}"] = (full_tensor(local.grad, spec, ctx) - ref.grad).abs().max().item()
        # accuracy counts the ignored label as a miss, like the dense argmax == label
        out[f"acc_{key}"] = (correct.item() - want_correct, total.item() - labels.numel())
    return out


def _all_layers(ctx):
    errs, sizes = {}, {}
    for name, (mk_d, mk_3, x, in_spec, out_spec, o) in _layer_cases(ctx).items():
        errs[name], sizes[name] = _parity(ctx, mk_d, mk_3, x, in_spec, out_spec, o)
    errs["loss"] = _loss_parity(ctx)
    bad = {}
    for what, make in [
        ("bias", lambda: m3.Linear(HID, 12, ctx=ctx)),
        ("batch", lambda: m3.split_batch(torch.zeros(6, HID), ctx)),
        ("width", lambda: m3.Linear(HID, HID, ctx=ctx)(torch.zeros(2, 3))),
    ]:
        try:
            make()
        except ValueError as e:
            bad[what] = str(e)
    drop = m3.Dropout(0.5, ctx=ctx)
    kept = drop(torch.ones(64, dtype=DT))
    same_in_eval = torch.equal(drop.eval()(torch.ones(4)), torch.ones(4))
    return errs, sizes, bad, (kept, same_in_eval)


def test_every_layer_matches_its_dense_twin():
    results = run_distributed(_all_layers, 8, config=CUBE, timeout=TIMEOUT)
    errs, sizes, bad, _ = results[0]
    masks = [r[3][0] for r in results]
    assert all(r[3][1] for r in results), "Dropout is the identity in eval mode"
    assert all(set(m.unique().tolist()) <= {0.0, 2.0} for m in masks)  # kept values scaled 1/(1-p)
    # every rank holds a different piece of an activation: a different mask on each
    assert len({tuple(m.tolist()) for m in masks}) == 8
    for layer, per in errs.items():
        for what, err in per.items():
            if what.startswith("acc_"):
                assert err == (0, 0), (layer, what, err)  # integer counts: exact
            else:
                assert err < TOL, (layer, what, err)
    for layer, per in sizes.items():
        for name, (local, full) in per.items():
            if layer == "classifier_replicated_bias" and name == "bias":
                assert local == full  # 6 classes do not split 8 ways: replicated by design
            else:
                assert local * 8 == full, (layer, name, local, full)  # 1/T of every shard
    assert "out_features=12 must be divisible by 8" in bad["bias"]
    assert "batch size (6,) must be divisible by d*d = 4" in bad["batch"]
    assert "last dim is 3" in bad["width"]


class TinyNet(nn.Module):
    """2-Linear MLP + LayerNorm + classifier, written once with gt.nn (any tensor mode).

    The first Linear takes split_batch's full-width features, as every mode allows.
    """

    def __init__(self, dtype=DT):
        super().__init__()
        self.fc1 = gnn.Linear(16, 32, dtype=dtype)
        self.fc2 = gnn.Linear(32, 16, dtype=dtype)
        self.norm = gnn.LayerNorm(16, dtype=dtype)
        self.head = gnn.Classifier(16, 8, dtype=dtype)

    def forward(self, x):
        return self.head(self.norm(self.fc2(F.gelu(self.fc1(x)))))


def _data():
    x = _rand(BATCH, 16, seed=11)
    y = torch.randint(0, 8, (BATCH,), generator=torch.Generator().manual_seed(12))
    return x, y


def _train(ctx, steps, state):
    """Per-step losses and the final full state dict of TinyNet trained with AdamW."""
    model = TinyNet()
    if ctx:
        load_full_state_dict(model, state, ctx)
    else:
        model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = _data()
    split = (lambda t: layers.split_batch(t, ctx)) if ctx else (lambda t: t)
    crit = gnn.CrossEntropyLoss() if ctx else nn.CrossEntropyLoss()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = crit(model(split(x)), split(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, full_state_dict(model, ctx) if ctx else model.state_dict()


def _dense_state(seed=0):
    torch.manual_seed(seed)
    return TinyNet().state_dict()


def test_tiny_model_equals_dense_after_three_adamw_steps():
    state = _dense_state()
    want_losses, want_state = _train(None, 3, state)
    results = run_distributed(_train, 8, 3, state, config=CUBE, timeout=TIMEOUT)
    for losses, got_state in results:  # every rank reports the dense numbers
        # float64; Adam's update divides by sqrt(v): still ~1e-13, 1e-9 leaves margin
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-9
        assert max((got_state[k] - v).abs().max().item() for k, v in want_state.items()) < 1e-9


def _round_trip(ctx, state):
    """Load a dense state dict, report its full state dict and the loss on the fixed batch."""
    model = TinyNet()
    load_full_state_dict(model, state, ctx)
    x, y = _data()
    loss = gnn.CrossEntropyLoss()(model(layers.split_batch(x, ctx)), layers.split_batch(y, ctx))
    return full_state_dict(model, ctx), loss.item()


def _perturbed_3d_state(ctx):
    """Train-like edit of the shards (different on every rank), then export the full dict."""
    torch.manual_seed(3)
    model = TinyNet()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(_rand(*p.shape, seed=1000 * ctx.global_rank + i))
    return full_state_dict(model, ctx)


LAYOUTS = {"3d": (8, CUBE)}
for _mode, _world, _cfg in [
    ("1d", 4, dict(parallel=dict(tensor=dict(size=4, mode="1d")))),
    ("2d", 4, dict(parallel=dict(tensor=dict(size=4, mode="2d")))),
    ("2.5d", 8, dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2)))),
]:
    _file = {"1d": "mode_1d", "2d": "mode_2d", "2.5d": "mode_2p5d"}[_mode]
    if importlib.util.find_spec(f"gridtrain.parallel.tensor.{_file}") is not None:
        LAYOUTS[_mode] = (_world, _cfg)


def test_checkpoint_round_trips_between_3d_dense_and_other_layouts(tmp_path):
    saved = run_distributed(_perturbed_3d_state, 8, config=CUBE, timeout=TIMEOUT)[0]
    torch.save(saved, tmp_path / "from_3d.pt")
    # 3d -> none: the dense model loads it and computes the same loss as 3d does
    dense_model = TinyNet()
    dense_model.load_state_dict(torch.load(tmp_path / "from_3d.pt"))
    x, y = _data()
    want = F.cross_entropy(dense_model(x), y).item()
    for mode, (world, cfg) in LAYOUTS.items():
        # -> mode -> full state dict again: bit-identical, and the same loss
        for got, loss in run_distributed(_round_trip, world, saved, config=cfg, timeout=TIMEOUT):
            assert set(got) == set(saved), mode
            assert all(torch.equal(got[k], v) for k, v in saved.items()), mode
            # float64: 3d differs only in sum order; other modes may take LayerNorm statistics
            # in float32 (mode_2d does), ~1e-7
            tol = 1e-10 if mode == "3d" else 1e-6
            assert abs(loss - want) < tol, (mode, loss, want)
    # none -> 3d: a dense-edited state comes back unchanged through the cube
    edited = {k: v + 0.5 for k, v in dense_model.state_dict().items()}
    got, _ = run_distributed(_round_trip, 8, edited, config=CUBE, timeout=TIMEOUT)[0]
    assert all(torch.equal(got[k], v) for k, v in edited.items())


def test_split_batch_is_the_dense_batch_in_rank_order():
    def order(rank):
        a, c = rank % 2, rank // 4  # t = k*d*d + j*d + i with i = A, k = C
        return 2 * a + c

    got = run_distributed(_split_rows, 8, config=CUBE, timeout=TIMEOUT)
    for rank, rows in enumerate(got):
        assert rows == [2 * order(rank), 2 * order(rank) + 1]


def _split_rows(ctx):
    return m3.split_batch(torch.arange(8), ctx).tolist()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
