"""ZeRO stages 1-3 (and stage 3 with offload) train a plain-PyTorch transformer to the losses and
weights of one process, under data, tensor and pipeline parallelism, while each rank's
``optimizer.state`` holds only its share."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import TinyTransformer, tiny_batches
from helpers.parity import dp_rows, seeded

import gridtrain as gt
from gridtrain.parallel.zero.memory import optimizer_state_numel

PM = gt.ParallelMode
STEPS, BATCH, SEQ, VOCAB, HIDDEN = 3, 8, 16, 64, 32
LR, CLIP = 1e-2, 0.05


def lm_loss(logits, labels):
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _model(dtype=torch.float64, tie=False):
    return seeded(lambda: TinyTransformer(vocab=VOCAB, hidden=HIDDEN, seq=SEQ, tie=tie), 0, dtype)


def _dense(batches, clip=0.0, tie=False):
    """One process, plain PyTorch: losses and final state."""
    model = _model(tie=tie)
    opt = _adamw(model)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(ctx, batches, dtype=torch.float64, inject_at=None):
    """Train through gt.initialize; per rank: losses, full state, optimizer-state elements,
    skipped flags, loss scales. ``TIE = True`` in the config ties the head to the embedding."""
    model = _model(dtype, tie=getattr(ctx.config, "TIE", False))
    x0 = dp_rows(batches[0][0], ctx)
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss, example_inputs=x0)
    accumulation = ctx.config.gradient_accumulation
    pipeline = ctx.world_size(PM.PIPELINE) > 1
    hook = None
    losses, skipped, scales = [], [], []
    for step, (x, y) in enumerate(batches):
        x, y = dp_rows(x, ctx), dp_rows(y, ctx)
        if step == inject_at and ctx.local_rank(PM.DATA) == 0:
            hook = _inject_inf_in_last_row(engine.model)
        engine.zero_grad()
        window = []
        for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation)):
            if pipeline:
                _, _, loss = engine.execute_schedule(iter([(xm, ym)]), return_output_label=False)
            else:
                loss = engine.criterion(engine(xm), ym)
                engine.backward(loss)
            window.append(loss.item())
        engine.step()
        if hook is not None:
            hook.remove()
            hook = None
        losses.append(sum(window) / len(window))
        skipped.append(engine.last_step_skipped)
        scaler = getattr(engine.optimizer, "scaler", None)
        if scaler is not None and hasattr(scaler, "get_scale"):  # torch's GradScaler
            scales.append(scaler.get_scale())
        else:
            scales.append(getattr(scaler, "scale", None))
    full = gt.full_state_dict(engine.model)
    return losses, full, optimizer_state_numel(engine.optimizer), skipped, scales


def _inject_inf_in_last_row(model):
    """This rank's gradient of the head weight gets inf in its last row only: after the
    reduce-scatter only the rank owning that row sees it."""
    head = gt.parallel.sharding.unwrap(model).head.weight

    def hook(grad):
        grad = grad.clone()
        grad[-1] = float("inf")
        return grad

    return head.register_hook(hook)


def _global_losses(results, world, config):
    par = config.get("parallel", {})
    pipeline = par.get("pipeline", 1)
    tensor = par.get("tensor", {}).get("size", 1)
    replica = pipeline * tensor
    rows = [r[0] for r in results[::replica]]
    if pipeline > 1:  # the loss is reported by the last stage
        rows = [r[0] for r in results[replica - tensor :: replica]]
    return torch.tensor(rows, dtype=torch.float64).mean(0).tolist()


# name: (world, config, dense clip); float64 throughout
LAYOUTS = {
    "dp4-stage1": (4, dict(zero=dict(stage=1)), 0.0),
    "dp4-stage2": (4, dict(zero=dict(stage=2)), 0.0),
    "dp4-stage3": (4, dict(zero=dict(stage=3)), 0.0),
    "dp4-stage3-offload": (4, dict(zero=dict(stage=3, offload=True)), 0.0),
    # blocks compiled (test_compile.py): FSDP2's gathers stay hooks outside the graphs
    "dp2-stage3-compiled": (2, dict(zero=3, compile=dict(backend="aot_eager")), 0.0),
    # each block recomputed in the backward (test_activation_checkpoint.py): FSDP2 gathers
    # the block for its backward, and the recompute runs inside that
    "dp2-stage3-recompute": (2, dict(zero=3, activation_checkpoint=True), 0.0),
    "dp2-1d2-stage2": (4, dict(parallel=dict(tensor=dict(size=2, mode="1d")), zero=2), 0.0),
    "1d2-stage1 (a data group of one)": (
        2,
        dict(parallel=dict(tensor=dict(size=2, mode="1d")), zero=1),
        0.0,
    ),
    "dp2-2d4-stage2": (8, dict(parallel=dict(tensor=dict(size=4, mode="2d")), zero=2), 0.0),
    "dp2-1d2-stage3": (4, dict(parallel=dict(tensor=dict(size=2, mode="1d")), zero=3), 0.0),
    "dp2-pp2-stage1": (4, dict(parallel=dict(pipeline=2), num_microbatches=2, zero=1), 0.0),
    "dp2-pp2-stage2": (4, dict(parallel=dict(pipeline=2), num_microbatches=2, zero=2), 0.0),
    "dp2-pp2-stage3": (4, dict(parallel=dict(pipeline=2), num_microbatches=2, zero=3), 0.0),
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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_equals_one_process(name):
    world, config, clip = LAYOUTS[name]
    batches = tiny_batches(STEPS, BATCH, SEQ, VOCAB)
    d_losses, d_final = _dense(batches, clip, tie=config.get("TIE", False))
    results = run_distributed(_train, world, batches, config=config, timeout=300)
    # float64: sharded sums only reorder additions (<= 1e-15 relative); AdamW divides by
    # sqrt(v) + 1e-8, so a 1e-16 gradient difference on a near-zero gradient can move a
    # weight by lr * 1e-16 / 1e-8 = 1e-10 per step; a wrong row is O(lr) = 1e-2
    assert _global_losses(results, world, config) == pytest.approx(d_losses, rel=1e-10), name
    for rank, (_, final, *_) in enumerate(results):
        assert set(final) == set(d_final)
        for k, v in d_final.items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=f"{name} {rank} {k}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_holds_a_quarter_of_the_optimizer_state(stage):
    batches = tiny_batches(1, BATCH, SEQ, VOCAB)
    results = run_distributed(_train, 4, batches, config=dict(zero=stage), timeout=300)
    dense = sum(p.numel() for p in _model().parameters())
    held = [r[2] for r in results]
    # AdamW keeps exp_avg and exp_avg_sq per element (its step counters are scalars);
    # every dim 0 of the model divides by 4, so the rows split exactly
    assert sum(held) == 2 * dense, held
    for h in held:
        assert h / (2 * dense) <= 1 / 4 + 1e-9, held


def test_naive_fp16_stage2_skips_an_injected_overflow_on_every_rank():
    """dp2, naive fp16: the same run without ZeRO is the reference (the fp16 batch split
    rounds differently from one process; with two ranks a+b sums alike in both)."""
    batches = tiny_batches(STEPS, BATCH, SEQ, VOCAB)
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
        x, y = dp_rows(batches[0][0], ctx), dp_rows(batches[0][1], ctx)
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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_communicates_only_in_the_last_micro_step(stage):
    batches = tiny_batches(1, BATCH, SEQ, VOCAB)
    config = dict(zero=stage, gradient_accumulation=2)
    for seen in run_distributed(
        _reduce_scatters_per_micro_step, 4, batches, 2, config=config, timeout=300
    ):
        assert seen[0] == 0 and seen[-1] > 0, seen
