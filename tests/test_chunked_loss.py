"""``chunked_loss``: the head and its cross entropy in token chunks give the unfused losses and
gradients in every tensor mode (vocab-split logits included), and never hold whole logits."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import tensor_of
from helpers.models import TinyTransformer
from helpers.runs import (
    assert_grads_close,
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    token_batches,
)

import gridtrain as gt
from gridtrain.parallel.tensor.chunked_loss import ChunkedHead, DeferredLogits

STEPS, BATCH, SEQ, VOCAB = 2, 8, 16, 64
CHUNK = dict(chunked_loss=dict(chunk_tokens=32))  # 128 tokens per batch: 4 chunks
LAYOUTS = {
    "one process": (1, {}),
    "1d2 vocab-split": (2, dict(tensor=dict(tensor_of("1d2"), plan={"head": "vocab_parallel"}))),
    "2d4": (4, dict(tensor=tensor_of("2d4"))),
    "3d8": (8, dict(tensor=tensor_of("3d8"))),
}


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _model():
    return seeded(lambda: TinyTransformer(vocab=VOCAB, seq=SEQ), seed=0)


def _reference(batches):
    return reference_run(_model, batches, dense_lm_loss, _adamw)


def _train(ctx, batches):
    model = _model()
    run = engine_run(ctx, lambda: model, batches, lm_loss, _adamw, example_inputs=batches[0][0])
    deferred = isinstance(model.head(torch.zeros(2, 3, 32, dtype=torch.float64)), DeferredLogits)
    found = model.head.forward._leaves  # (key, weights) once the no-recompute path ran
    return run, deferred, bool(found and found[1])


@pytest.mark.parametrize("recompute", [False, True], ids=["grads in forward", "recompute"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_loss_equals_the_whole_logits_loss(name, recompute):
    world, parallel = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = _reference(batches)
    d_losses, d_final = ref.losses, ref.state
    config = dict(chunked_loss=dict(CHUNK["chunked_loss"], recompute=recompute), parallel=parallel)
    for rank, (run, deferred, in_forward) in enumerate(
        run_distributed(_train, world, batches, config=config, timeout=300)
    ):
        losses, grads, final, held = run.losses, run.grads[0], run.state, run.shares
        assert deferred, "the head returns deferred logits while training"
        assert in_forward != recompute, "the path the config asks for ran"
        # really sharded: the chunked head and every block matrix are 1/world of the dense
        # (a replica would hold all of each; 1d's LayerNorms and row-parallel biases stay whole)
        mats = [
            k for k in held if k.startswith("blocks.") and k.endswith("weight") and ".ln" not in k
        ]
        assert mats and all(held[k] == 1 / world for k in [*mats, "head.weight"]), (name, held)
        # float64: chunking and sharding only reorder sums
        assert losses == pytest.approx(d_losses, rel=1e-12), (name, rank)
        assert_grads_close(grads, ref, msg=name, rtol=1e-10, atol=1e-12)
        for k, v in d_final.items():  # AdamW on near-zero gradients: see test_plain_model_parity
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=f"{name} {k}")


DATA_PARALLEL = {"dp2": {}, "dp2 zero1": dict(zero=1), "dp2 zero2": dict(zero=2)}


@pytest.mark.parametrize("name", list(DATA_PARALLEL))
def test_chunked_loss_gradients_reach_data_parallel_sync(name):
    """The head's gradients, handed over in the backward by the no-recompute path, still
    go through the gradient sync (all-reduce, ZeRO 1 and 2's reduce-scatter hooks)."""
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = _reference(batches)
    results = run_distributed(_train, 2, batches, config=dict(CHUNK, **DATA_PARALLEL[name]))
    # each rank's loss is over its half of the batch; equal halves, so the mean is the dense
    runs = [r[0] for r in results]
    assert global_losses(runs) == pytest.approx(ref.losses, rel=1e-12), name  # float64
    for rank, (run, deferred, _) in enumerate(results):
        assert deferred, f"rank {rank}: the head returns deferred logits while training"
        # the gradients the optimizer stepped with (ZeRO 1 and 2: its rows, reduce-scattered)
        assert run.grads[0].keys() == ref.grads[0].keys()
        for k, g in ref.grads[0].items():
            torch.testing.assert_close(
                run.grads[0][k], g, rtol=1e-10, atol=1e-12, msg=f"{rank} {k}"
            )
        for k, v in ref.state.items():  # two AdamW steps from the synced gradients
            torch.testing.assert_close(run.state[k], v, rtol=1e-4, atol=1e-8, msg=f"{rank} {k}")


def test_chunked_loss_with_zero_3_is_refused_by_name():
    # FSDP2 reshards the head after the model's forward; the deferred head would then meet
    # sharded weights in the loss ("mixed torch.Tensor and DTensor"): refused up front
    with pytest.raises(gt.ConfigError, match="chunked_loss .* zero.stage 1 or 2"):
        gt.Config.from_dict(dict(CHUNK, zero=3))


def _heads(chunk: int, h: int, v: int, dtype=torch.float64):
    """A chunked head with recompute off, and an unfused copy with the same weights."""
    torch.manual_seed(0)
    head = torch.nn.Linear(h, v).to(dtype)
    ref = torch.nn.Linear(h, v).to(dtype)
    ref.load_state_dict(head.state_dict())
    ChunkedHead.enable(head, v, False, chunk, recompute=False)
    return head, ref


def _grads(head, x, y, scale: float = 1.0, autocast=None):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = gt.nn.CrossEntropyLoss()(head(x), y)
    (loss * scale).backward()
    return head.weight.grad.clone(), x.grad


def test_a_head_unfrozen_after_a_chunked_step_trains():
    head, ref = _heads(chunk=5, h=4, v=6)
    x, y = torch.randn(2, 8, 4, dtype=torch.float64), torch.randint(0, 6, (2, 8))
    head.requires_grad_(False)  # frozen for a warm-up step
    gt.nn.CrossEntropyLoss()(head(x.clone().requires_grad_()), y).backward()
    head.requires_grad_(True)
    got, got_x = _grads(head, x, y)
    want, want_x = _grads(ref, x, y)
    # float64; without the requires_grad in the leaves' cache key the weight got no gradient
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-15)


def test_a_batch_with_every_label_ignored_gives_zero_gradients_not_nan():
    head, ref = _heads(chunk=5, h=4, v=6)
    x, y = torch.randn(2, 8, 4, dtype=torch.float64), torch.full((2, 8), -100)
    got, got_x = _grads(head, x, y)  # the loss is 0/0 = nan in both; its scale 1/0 = inf
    want, want_x = _grads(ref, x, y)
    assert torch.equal(want, torch.zeros_like(want)), "the unfused loss's gradient is zero"
    assert torch.equal(got, want) and torch.equal(got_x, want_x), "0 * inf stays 0"


def test_fp16_recomputes_so_a_chunk_weight_gradient_cannot_overflow():
    # 4096 tokens of one label with a feature of 40 (an outlier after a final norm): the
    # summed loss's weight gradient for it is -40 * 4096 = -163840, past fp16's 65504,
    # while the mean loss's is -40
    head, ref = _heads(chunk=4096, h=8, v=16, dtype=torch.float32)
    x = torch.randn(1, 4096, 8)
    x[..., 0] = 40.0
    y = torch.zeros(1, 4096, dtype=torch.long)
    got, _ = _grads(head, x, y, autocast=torch.float16)
    want, _ = _grads(ref, x, y, autocast=torch.float16)
    assert torch.isfinite(got).all(), "fp16 must take the recompute path"
    # fp16 GEMMs accumulate the same products in another order: ~1e-3 relative
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)
