"""Gemini (``zero = dict(stage=3, offload=True)``): the offloaded engine trains a plain-PyTorch
transformer to the losses and weights of one process, whether its chunks stay on the device
or stream, under data, tensor and pipeline parallelism, accumulation, clipping and activation
checkpointing, while each rank keeps only its rows of the masters; checkpoints and state dicts
load back into it; the one-step delayed update trains as far as the exact one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.runs import (
    data_rows,
    dense_lm_loss,
    engine_step,
    global_losses,
    lm_loss,
    reference_run,
    shares,
    token_batches,
)
from test_zero import BATCH, CLIP, SEQ, STEPS, VOCAB, _adamw, _model

import gridtrain as gt

GEMINI = dict(stage=3, offload=True)
# each block recomputed in the backward, two micro-steps; SDPA's math kernel preferred in the
# forward, where torch's default order takes the CPU's flash kernel (as cuDNN first, Hopper's
# default, against flash on a GPU): a recompute that forgot the preference saves other
# tensors and torch's checkpoint refuses them
RECOMPUTE = dict(
    gradient_accumulation=2, activation_checkpoint=True, attention=dict(backends=["math"])
)


def _dense_loss(logits, labels):
    """``dense_lm_loss`` in float64 whatever the model's dtype (the bf16 test's float32
    reference included)."""
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten())


def _dense(batches, clip=0.0, tie=False, dtype=torch.float64):
    """One process, plain PyTorch: the harness's reference run."""
    ref = reference_run(lambda: _model(dtype, tie), batches, _dense_loss, _adamw, clip=clip)
    return ref.losses, ref.state


def _train(ctx, batches, dtype=torch.float64):
    """Per rank: mean loss per step, the full state, this rank's share of each parameter,
    the bytes moved and the device bytes the offloaded engine held after training."""
    model = _model(dtype, tie=getattr(ctx.config, "TIE", False))
    dense = {n: p.numel() for n, p in model.named_parameters()}
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss, example_inputs=batches[0][0][:1])
    losses = [engine_step(engine, *data_rows(batch, ctx), ctx) for batch in batches]
    held = shares(engine, dense)
    moved = engine.zero.transfer_bytes()
    report = engine.zero.memory_report()
    return losses, gt.full_state_dict(engine.model), held, moved, report


def _global_losses(results):
    return global_losses([r[0] for r in results])


# name: (world, config, dense clip, data-parallel size); float64 throughout
LAYOUTS = {
    # every chunk streamed: fetched before each forward and backward, freed after
    "dp1-streamed": (1, dict(zero=dict(GEMINI, device_param_mb=0)), 0.0, 1),
    # the root chunk resident, the blocks streamed; rows cut 4 ways; two micro-steps summed
    # on the host; each block recomputed in the backward from its fetched copy
    "dp4-partly-streamed-accumulate2-recompute": (
        4,
        dict(
            zero=dict(GEMINI, device_param_mb=0.03),
            gradient_accumulation=2,
            activation_checkpoint=True,
        ),
        0.0,
        4,
    ),
    "dp1-recompute": (1, dict(RECOMPUTE, zero=GEMINI), 0.0, 1),
    "dp2-streamed-recompute": (2, dict(RECOMPUTE, zero=dict(GEMINI, device_param_mb=0)), 0.0, 2),
    "dp2-1d2": (4, dict(parallel=dict(tensor=dict(size=2, mode="1d")), zero=GEMINI), 0.0, 2),
    "dp2-pp2-streamed": (
        4,
        dict(parallel=dict(pipeline=2), num_microbatches=2, zero=dict(GEMINI, device_param_mb=0)),
        0.0,
        2,
    ),
    "dp2-clip": (2, dict(zero=GEMINI, clip_grad_norm=CLIP), CLIP, 2),
    # the head registers the embedding's parameter: one slot, swapped in both modules
    "dp2-tied": (2, dict(zero=GEMINI, TIE=True), 0.0, 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gemini_equals_one_process(name):
    world, config, clip, dp = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    d_losses, d_final = _dense(batches, clip, tie=config.get("TIE", False))
    results = run_distributed(_train, world, batches, config=config, timeout=300)
    # float64: the reduce-scatter and the host sums only reorder additions; AdamW's
    # 1/(sqrt(v) + 1e-8) can turn a 1e-16 gradient difference into 1e-10 of weight per
    # step; a wrong row or a stale device copy is off by O(lr) = 1e-2
    assert _global_losses(results) == pytest.approx(d_losses, rel=1e-10), name
    for rank, (_, final, held, moved, report) in enumerate(results):
        assert set(final) == set(d_final)
        for k, v in d_final.items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=f"{name} {rank} {k}")
        # each rank's masters are its rows only: 1/dp of its tensor-parallel shard (or less)
        assert held and max(held.values()) <= 1 / dp + 1e-9, (name, rank, held)
        assert moved["d2h"] > 0 and moved["h2d"] > 0, moved
        if "streamed" in name:
            # a streamed block's copy is on the device only while in use
            budget = config["zero"]["device_param_mb"] * 2**20
            assert report["device_params"] <= budget, (name, rank, report, budget)
        if name == "dp2-streamed-recompute":
            # every chunk fetched twice per micro-step (before its forward, before its
            # backward, whose copy the recompute uses: a released copy raises when read), in
            # float64 from the masters, which are half of the host segments (gradients the
            # other half): per step 2 micro-steps x 2 fetches
            assert moved["h2d"] == STEPS * 2 * 2 * report["host_segments"] // 2, (moved, report)


def _load_into_gemini(ctx, batches, path):
    """Train two steps offloaded (streamed), save dense; a fresh offloaded engine loads it
    and a plain state dict too, and both take the third step."""
    model = _model()
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss)
    for batch in batches[:2]:
        engine_step(engine, *data_rows(batch, ctx), ctx)
    gt.save_checkpoint(path, 2, engine.model, engine.optimizer)
    model2 = _model()
    fresh, *_ = gt.initialize(model2, _adamw(model2), lm_loss)
    fresh(data_rows(batches[0][0], ctx))  # the device copies exist before the load replaces them
    assert gt.load_checkpoint(path, fresh.model, fresh.optimizer) == 2
    loss = engine_step(fresh, *data_rows(batches[2], ctx), ctx)
    return loss, gt.full_state_dict(fresh.model)


def test_a_checkpoint_loads_into_a_streamed_gemini_engine(tmp_path):
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    d_losses, d_final = _dense(batches)
    config = dict(zero=dict(GEMINI, device_param_mb=0.02))
    results = run_distributed(
        _load_into_gemini, 2, batches, tmp_path / "ckpt.pt", config=config, timeout=300
    )
    # the third step from loaded weights and Adam moments (the mean over the two data
    # ranks' halves): a device copy not refreshed after the load would compute with the
    # untrained weights (loss off by ~0.1)
    assert sum(loss for loss, _ in results) / 2 == pytest.approx(d_losses[2], rel=1e-10)
    for _, final in results:
        for k, v in d_final.items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=k)


def test_bf16_gemini_computes_in_bf16_and_tracks_the_fp32_run():
    """Under bf16 amp the device copies are bf16 (as FSDP2's bf16 policy gathers them) and
    the masters fp32: the losses follow the dense bf16-autocast run to bf16 rounding."""
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    config = dict(fp16=dict(mode="bf16"), zero=dict(GEMINI, device_param_mb=0.02))
    results = run_distributed(_train, 2, batches, torch.float32, config=config, timeout=300)
    d_losses, d_final = _dense(batches, dtype=torch.float32)
    # bf16 keeps 8 mantissa bits: a loss of ~4.2 moves by ~1e-2 through the weights' and
    # activations' rounding; a wrong update moves it by more than the 0.15 three steps of
    # lr 1e-2 take off
    assert _global_losses(results) == pytest.approx(d_losses, abs=0.03)
    for _, final, *_ in results:
        assert all(v.dtype == torch.float32 for v in final.values())  # the fp32 masters


def _link(ctx, batches):
    """Per rank: losses, the bytes moved, the dtypes of the gradients the optimizer stepped
    with (the host rows)."""
    model = _model(torch.float32)
    engine, *_ = gt.initialize(model, _adamw(model), lm_loss, example_inputs=batches[0][0][:1])
    losses = [engine_step(engine, *data_rows(batch, ctx), ctx) for batch in batches]
    grads = {str(p.grad.dtype) for g in engine.optimizer.param_groups for p in g["params"]}
    return losses, engine.zero.transfer_bytes(), grads


def test_bf16_gemini_sends_bf16_halving_the_link_and_sums_in_fp32():
    """A bf16 run sends each backward's gradient rows in bf16 and uploads the masters in bf16:
    half the bytes of the fp32 run of the same layout (what every bf16 run sent before); the
    host sums the two micro-steps in fp32 and the run tracks the fp32 one."""
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    base = dict(zero=GEMINI, gradient_accumulation=2)  # every chunk resident (CPU default)
    bf16 = run_distributed(
        _link, 2, batches, config=dict(base, fp16=dict(mode="bf16")), timeout=300
    )
    fp32 = run_distributed(_link, 2, batches, config=base, timeout=300)
    for (_, moved, grads), (_, moved32, grads32) in zip(bf16, fp32, strict=True):
        assert moved["d2h"] * 2 == moved32["d2h"] > 0, (moved, moved32)
        assert moved["h2d"] * 2 == moved32["h2d"] > 0, (moved, moved32)
        assert grads == grads32 == {"torch.float32"}  # the host rows the step reads
    # bf16 keeps 8 mantissa bits: compute rounding moves a loss of ~4.2 by up to ~1e-2;
    # sending the rows in bf16 rounds each micro-step's mean once more (2^-9 relative) before
    # the fp32 sum, far below that; a lost micro-step or a stale upload moves the later losses
    # by the 0.1 that AdamW's steps of lr 1e-2 take off. (Weights are not compared: AdamW
    # turns a key bias's gradient, zero but for rounding, into full lr-sized steps of either
    # sign in both runs.)
    assert _global_losses(bf16) == pytest.approx(_global_losses(fp32), abs=0.02)


def _dense_delayed(batches):
    """ZeRO-Offload's delayed update in one process: the first two gradients at the current
    weights, then gradient k at the weights before step k - 1 (the device copy lags a step)."""
    master, work = _model(), _model()
    opt = _adamw(master)
    history = [{k: v.clone() for k, v in master.state_dict().items()}]
    losses = []
    for k, (x, y) in enumerate(batches, start=1):
        work.load_state_dict(history[-1] if k <= 2 else history[-2])
        work.zero_grad()
        loss = dense_lm_loss(work(x), y)
        loss.backward()
        for p, q in zip(master.parameters(), work.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        history.append({k: v.clone() for k, v in master.state_dict().items()})
        losses.append(loss.item())
    return losses, history[-1]


def test_delayed_update_is_zero_offloads_one_step_stale_update():
    """The delayed run equals its single-process definition exactly (float64), and still
    learns: over six steps its loss falls as the exact run's does."""
    batches = token_batches(6, BATCH, SEQ, VOCAB, seed=0)
    config = dict(zero=dict(GEMINI, delayed_update=True))
    results = run_distributed(_train, 2, batches, config=config, timeout=300)
    want_losses, want_final = _dense_delayed(batches)
    # float64, as the exact path; a step applied on time (no delay) changes the third loss
    # by O(lr) = 1e-2
    assert _global_losses(results) == pytest.approx(want_losses, rel=1e-10)
    for _, final, *_ in results:  # the state dict waits for the step still running
        for k, v in want_final.items():
            torch.testing.assert_close(final[k], v, rtol=1e-4, atol=1e-8, msg=k)
    exact, _ = _dense(batches)
    delayed = _global_losses(results)
    assert delayed[-1] < delayed[0] - 0.5 * (exact[0] - exact[-1]), (delayed, exact)


def test_estimate_counts_gemini_as_the_runtime_moves_it():
    """``gridtrain estimate`` (process-free) gives an fp32 Gemini run's host-link bytes by the
    runtime's formula (``offload_plan.transfer_per_step``): each backward sending the gradient
    rows, each step bringing the masters back; 16 bytes per parameter on the host besides the
    link's staging buffers, fp32 copies on the device."""
    from gridtrain import estimate as est
    from gridtrain.parallel.zero.offload_plan import ChunkShape, transfer_per_step

    spec = est.get_model("gpt2-124m")
    sc = est.Scenario(world=1, micro_batch=2, accumulation=3, amp=None, zero=3, offload=True)
    states = est.estimate(spec, sc, est.get_device("h200-141g")).worst.states
    rows = states.part("rows")
    assert rows == pytest.approx(124e6, rel=0.05)  # GPT-2 small, one rank holds every row
    runtime = transfer_per_step([ChunkShape(int(rows), int(rows), True)], 3, 4, 4)
    assert states.part("pcie_h2d") == runtime["h2d"]
    assert states.part("pcie_d2h") == runtime["d2h"]  # one gradient send per backward
    # + two staging buffers of the largest chunk (the 38.6M-row embedding, 4 bytes each)
    assert 16 * rows < states.host_total < 19 * rows
    assert states.part("weights") == 4 * rows  # fp32 copies of every parameter
