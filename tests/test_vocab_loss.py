"""One cross-entropy core for every mode: gt.nn.CrossEntropyLoss on vocab-split and gathered
logits equals F.cross_entropy (values and gradients) with ignore_index, label smoothing, class
weights and every reduction, under 1d, 2d, 2.5d and 3d; accuracy takes the first maximum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.layer_parity import cut, max_err, randn
from helpers.layouts import tensor_of

import gridtrain as gt
from gridtrain.parallel.tensor.registry import split_batch
from gridtrain.parallel.tensor.vocab import mark_vocab_sharded

B, S, V = 8, 3, 32


def _labels():
    y = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(12))
    y[1, 1] = y[5, 0] = -100  # ignored
    return y


CASES = [
    dict(reduction=r, label_smoothing=ls, weight=w)
    for r in ("mean", "sum", "none")
    for ls in (0.0, 0.1)
    for w in (False, True)
]


def _run(ctx):
    full = randn(11, B, S, V) * 3
    labels, weight = _labels(), torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.5
    rows = split_batch(labels, ctx)
    errs = {}
    for case in CASES:
        kw = dict(case, weight=weight if case["weight"] else None)
        for sharded in (True, False):
            tag = f"{'vocab' if sharded else 'gathered'} {case}"
            xd = full.clone().requires_grad_()
            ld = F.cross_entropy(xd.flatten(0, 1), labels.flatten(), **kw)
            ld.backward(torch.ones_like(ld))
            layout = "vocab" if sharded else "rows"
            xl = cut(full, layout, ctx).clone().requires_grad_()
            logits = mark_vocab_sharded(xl) if sharded else xl
            loss = gt.nn.CrossEntropyLoss(**kw)(logits, rows)
            loss.backward(torch.ones_like(loss))
            if case["reduction"] != "none":  # per-token values live on this rank's rows
                errs[f"loss {tag}"] = max_err(loss, ld)
            errs[f"grad {tag}"] = max_err(xl.grad, cut(xd.grad, layout, ctx))
    # bf16 logits are upcast inside: equal to F.cross_entropy of the same values
    xb = full.to(torch.bfloat16)
    lb = gt.nn.CrossEntropyLoss()(mark_vocab_sharded(cut(xb, "vocab", ctx)), rows)
    errs["loss bf16"] = max_err(lb, F.cross_entropy(xb.float().flatten(0, 1), labels.flatten()))
    # integer logits tie across ranks: the global argmax takes the first index, as torch
    ties = torch.randint(0, 3, (B, S, V), generator=torch.Generator().manual_seed(13)).float()
    correct, total = gt.nn.accuracy(mark_vocab_sharded(cut(ties, "vocab", ctx)), rows)
    want, want_total = (ties.argmax(dim=-1) == labels).sum(), labels.numel()  # dense
    errs["accuracy"] = float(correct.item() != want.item() or total.item() != want_total)
    return errs


LAYOUTS = {
    "1d-2": (2, tensor_of("1d2")),
    "1d-4": (4, tensor_of("1d4")),
    "2d-4": (4, tensor_of("2d4")),
    "2.5d-8": (8, tensor_of("2.5d8")),
    "3d-8": (8, tensor_of("3d8")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cross_entropy_equals_torch_in_every_mode(layout):
    world, tensor = LAYOUTS[layout]
    for rank, errs in enumerate(
        run_distributed(_run, world, config=dict(parallel=dict(tensor=tensor)))
    ):
        assert errs.pop("accuracy") == 0.0, rank
        for what, err in errs.items():
            # float32 logsumexp from per-rank partial sums and sums over row blocks: reordered
            # sums of <= 32 exp terms, a few ulps relative to max(1, |loss|); a dropped
            # weight, smoothing term or row block is O(0.1)
            assert err < 2e-6, f"{layout} rank {rank} {what}: {err}"
