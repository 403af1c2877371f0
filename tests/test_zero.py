"""ZeRO stages 1-3 (and stage 3 with offload) train a plain-PyTorch transformer to the losses and
weights of one process, under data, tensor and pipeline parallelism, while each rank's
``optimizer.state`` holds only its share."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.models import TinyTransformer
from helpers.runs import (
    data_rows,
    dense_lm_loss,
    engine_step,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    state_share,
    token_batches,
)

import gridtrain as gt

PM = gt.ParallelMode
STEPS, BATCH, SEQ, VOCAB, HIDDEN = 3, 8, 16, 64, 32
LR, CLIP = 1e-2, 0.05


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _model(dtype=torch.float64, tie=False):
    return seeded(lambda: TinyTransformer(vocab=VOCAB, hidden=HIDDEN, seq=SEQ, tie=tie), 0, dtype)


def _dense(batches, clip=0.0, tie=False):
    """One process, plain PyTorch: the harness's reference run."""
    return reference_run(lambda: _model(tie=tie), batches, dense_lm_loss, _adamw, clip=clip)


def _train(ctx, batches, dtype=torch.float64, inject_at=None):
    """Train through gt.initialize; per rank: losses, full state, this rank's share of the
    dense optimizer state, skipped flags, loss scales. ``TIE = True`` in the config ties the
    head to the embedding."""
    model = _model(dtype, tie=getattr(ctx.config, "TIE", False))
    dense = sum(p.numel() for p in model.parameters())
    x0 = data_rows(batches[0][0], ctx)
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss, example_inputs=x0)
    losses, skipped, scales = [], [], []
    for step, batch in enumerate(batches):
        hook = None
        if step == inject_at and ctx.local_rank(PM.DATA) == 0:
            hook = _inject_inf_in_last_row(model)
        losses.append(engine_step(engine, *data_rows(batch, ctx), ctx))
        if hook is not None:
            hook.remove()
        skipped.append(engine.last_step_skipped)
        scaler = getattr(engine.optimizer, "scaler", None)
        if scaler is not None and hasattr(scaler, "get_scale"):  # torch's GradScaler
            scales.append(scaler.get_scale())
        else:
            scales.append(getattr(scaler, "scale", None))
    full = gt.full_state_dict(engine.model)
    return losses, full, state_share(engine, dense), skipped, scales


def _inject_inf_in_last_row(model):
    """This rank's gradient of the head weight gets inf in its last row only: after the
    reduce-scatter only the rank owning that row sees it."""

    def hook(grad):
        grad = grad.clone()
        grad[-1] = float("inf")
        return grad

    return model.head.weight.register_hook(hook)


# name: (world, config, dense clip); float64 throughout
LAYOUTS = {
    "dp4-stage1": (*layout("dp4", zero=dict(stage=1)), 0.0),
    "dp4-stage2": (*layout("dp4", zero=dict(stage=2)), 0.0),
    "dp4-stage3": (*layout("dp4", zero=dict(stage=3)), 0.0),
    "dp4-stage3-offload": (*layout("dp4", zero=dict(stage=3, offload=True)), 0.0),
    # blocks compiled (test_compile.py): FSDP2's gathers stay hooks outside the graphs
    "dp2-stage3-compiled": (2, dict(zero=3, compile=dict(backend="aot_eager")), 0.0),
    # each block recomputed in the backward (test_activation_checkpoint.py): FSDP2 gathers
    # the block for its backward, and the recompute runs inside that
    "dp2-stage3-recompute": (2, dict(zero=3, activation_checkpoint=True), 0.0),
    "dp2-1d2-stage2": (*layout("dp2-1d2", zero=2), 0.0),
    "1d2-stage1 (a data group of one)": (*layout("1d2", zero=1), 0.0),
    "dp2-2d4-stage2": (*layout("dp2-2d4", zero=2), 0.0),
    "dp2-1d2-stage3": (*layout("dp2-1d2", zero=3), 0.0),
    "dp2-pp2-stage1": (*layout("dp2-pp2", num_microbatches=2, zero=1), 0.0),
    "dp2-pp2-stage2": (*layout("dp2-pp2", num_microbatches=2, zero=2), 0.0),
    "dp2-pp2-stage3": (*layout("dp2-pp2", num_microbatches=2, zero=3), 0.0),
    # the tied embedding and head live on two stages: their bucket waits for the handler
    "dp2-pp2-tied-stage2": (
        4,
        dict(parallel=dict(pipeline=2), num_microbatches=2, zero=2, TIE=True),
        0.0,
    ),
    "dp4-stage2-accumulate2": (4, dict(zero=2, gradient_accumulation=2), 0.0),
    "dp4-stage3-accumulate2": (4, dict(zero=3, gradient_accumulation=2), 0.0),
    "dp4-stage2-clip": (4, dict(zero=2, clip_grad_norm=CLIP), CLIP),
    "dp4-stage3-clip": (4, dict(zero=3, clip_grad_norm=CLIP), CLIP),
}


@functools.cache
def _layout(name):
    """Each rank's results of ``_train`` in layout ``name`` (one distributed call per layout,
    shared by the tests that read it)."""
    world, config, _ = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    return run_distributed(_train, world, batches, config=config, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_equals_one_process(name):
    world, config, clip = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = _dense(batches, clip, tie=config.get("TIE", False))
    d_final = ref.state
    results = _layout(name)
    # float64: sharded sums only reorder additions (<= 1e-15 relative); AdamW divides by
    # sqrt(v) + 1e-8, so a 1e-16 gradient difference on a near-zero gradient can move a
    # weight by lr * 1e-16 / 1e-8 = 1e-10 per step; a wrong row is O(lr) = 1e-2
    assert global_losses([r[0] for r in results]) == pytest.approx(ref.losses, rel=1e-10), name
    for rank, (_, final, held, *_) in enumerate(results):
        assert set(final) == set(d_final)
        for k, v in d_final.items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=f"{name} {rank} {k}")
        # each rank's AdamW state is its share of one copy: 1/world of it, up to what the
        # layout keeps whole (measured <= 1.089 / world): 1d keeps its norms and row biases
        # on both tensor ranks (1.015), a pipeline cut is not exactly half (1.015 / 0.985),
        # the tied embedding lives on both stages (1.089). The same layout without ZeRO
        # holds >= 1.97 / world; with a data group of one (1d2-stage1) a rank that is not
        # tensor-parallel holds 2 / world
        assert held <= 1.1 / world, (name, rank, held)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_holds_a_quarter_of_the_optimizer_state(stage):
    # the dp4 run of that stage above (same config): a rank's rows are fixed at initialize,
    # so its share after three steps is its share after one
    results = _layout(f"dp4-stage{stage}")
    held = [r[2] for r in results]
    # AdamW keeps exp_avg and exp_avg_sq per element (its step counters are scalars);
    # every dim 0 of the model divides by 4, so the rows split exactly: the shares add up
    # to one copy of the state (sums of k / 2^n, exact in float64)
    assert sum(held) == 1.0, held
    for h in held:
        assert h <= 1 / 4 + 1e-9, held


def test_naive_fp16_stage2_skips_an_injected_overflow_on_every_rank():
    """dp2, naive fp16: the same run without ZeRO is the reference (the fp16 batch split
    rounds differently from one process; with two ranks a+b sums alike in both)."""
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    fp16 = dict(mode="naive", initial_scale=2.0**10, hysteresis=1)
    plain = run_distributed(
        _train, 2, batches, torch.float32, 1, config=dict(fp16=fp16), timeout=300
    )
    zero = run_distributed(
        _train, 2, batches, torch.float32, 1, config=dict(fp16=fp16, zero=2), timeout=300
    )
    for rank in range(2):
        losses, final, _, skipped, scales = zero[rank]
        assert skipped == [False, True, False], (rank, skipped)
        assert scales == [2.0**10, 2.0**9, 2.0**9], scales  # backed off once, on every rank
        assert skipped == plain[rank][3] and scales == plain[rank][4]
        # same fp16 forward and backward, same fp16 sum of two gradients, fp32 AdamW on
        # the same values (only cut into rows): equal to float32 rounding
        assert losses == pytest.approx(plain[rank][0], rel=1e-6)
        for k, v in plain[rank][1].items():
            torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _reduce_scatters_per_micro_step(ctx, batches, accumulation):
    """Reduce-scatters issued after each micro-step of one window (and after its step)."""
    import torch.distributed as dist

    from gridtrain.parallel.zero import row_buckets

    calls = []
    originals = (row_buckets.reduce_scatter_single, dist.reduce_scatter_single)

    def counting(*args, **kwargs):
        calls.append(1)
        return originals[1](*args, **kwargs)

    row_buckets.reduce_scatter_single = dist.reduce_scatter_single = counting
    try:
        model = _model()
        engine, *_ = gt.initialize(model, _adamw(model), lm_loss)
        x, y = data_rows(batches[0], ctx)
        seen = []
        engine.zero_grad()
        for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation)):
            engine.backward(engine.criterion(engine(xm), ym))
            seen.append(len(calls))
        engine.step()
        seen.append(len(calls))
        return seen
    finally:
        row_buckets.reduce_scatter_single, dist.reduce_scatter_single = originals


@pytest.mark.parametrize(
    "zero, each",
    [
        (1, False),  # stage 1 keeps full gradients and reduces once per step
        (2, True),  # stage 2 reduces into its rows in every micro-step
        (3, True),  # stage 3: sharded accumulation, as torchtitan runs FSDP2
        (dict(stage=3, keep_unsharded_grads=True), False),
    ],
)
def test_when_accumulation_communicates(zero, each):
    batches = token_batches(1, BATCH, SEQ, VOCAB, seed=0)
    config = dict(zero=zero, gradient_accumulation=2)
    for seen in run_distributed(
        _reduce_scatters_per_micro_step, 4, batches, 2, config=config, timeout=300
    ):
        if each:  # both micro-steps reduce the same buckets; the step adds none
            assert 0 < seen[0] and seen[1] == 2 * seen[0] and seen[2] == seen[1], seen
        else:
            assert seen[0] == 0 and seen[-1] > 0, seen
