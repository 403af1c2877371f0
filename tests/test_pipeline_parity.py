"""Pipeline schedules on gloo processes equal the dense model trained on the whole batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.harness import run_distributed
from helpers.pipeline_models import (
    LMLoss,
    batches,
    data_slice,
    dense_model,
    param_groups,
    tied_lm,
    train_dense,
)

import gridtrain as gt
from gridtrain.parallel.sharding import unwrap
from gridtrain.parallel.tags import is_pipeline_shared

STEPS = 3


def data_slice_rows(x, d, dp):
    return x.chunk(dp)[d]


MICRO = 8


def _train_pipeline(ctx, data, lazy: bool = False):
    """Train from the dense model's weights; returns losses, full state dict, first-step grads.

    ``lazy``: build the model on the meta device; each stage allocates only its layers.
    """
    torch.manual_seed(123)  # a different init: the loaded state dict must define the weights
    with gt.lazy_init() if lazy else contextlib.nullcontext():
        model = tied_lm()
    if not lazy:
        gt.load_full_state_dict(model, dense_model().state_dict(), ctx)
    opt = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    example = data_slice(data[0][0], ctx)  # traced on meta when a tensor mode needs a plan
    engine, *_ = gt.initialize(model, opt, LMLoss(), ctx=ctx, example_inputs=example)
    if lazy:
        gt.load_full_state_dict(engine.model, dense_model().state_dict(), ctx)
    engine.train()
    losses, grads = [], {}
    for step, (x, y) in enumerate(data):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([(data_slice(x, ctx), data_slice(y, ctx))]))
        if step == 0 and ctx.tensor_parallel_size == 1 and ctx.data_parallel_size == 1:
            # before step(): no data-parallel or tied-weight reduction has happened yet
            grads = {n: p.grad.clone() for n, p in unwrap(engine.model).named_parameters()}
        engine.step()
        losses.append(loss.item())
    engine.eval()  # forward-only evaluation: outputs and labels on the last stage
    x, y = data[0]
    out, label, eval_loss = engine.execute_schedule(
        iter([(data_slice(x, ctx), data_slice(y, ctx))]), forward_only=True
    )
    stage = unwrap(engine.model)
    shared = sorted(n for n, p in stage.named_parameters() if is_pipeline_shared(p))
    info = dict(
        chunks=stage.chunk_layer_names,
        shared=shared,
        handlers=[type(h).__name__ for h in engine.gradient_handlers],
        schedule=type(engine.schedule).__name__,
        eval=(out, label, eval_loss.item()),
        optimizer_groups=[
            {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
            for g in engine.optimizer.param_groups
        ],
    )
    return losses, gt.full_state_dict(engine.model, ctx), grads, info


LAYOUTS = {
    "pp2-1f1b": (2, dict(parallel=dict(pipeline=2))),
    "pp4-1f1b": (4, dict(parallel=dict(pipeline=4))),
    "pp2-interleaved": (2, dict(parallel=dict(pipeline=dict(size=2, num_chunks=2)))),
    "pp4-interleaved": (4, dict(parallel=dict(pipeline=dict(size=4, num_chunks=2)))),
    "pp4-params-partition": (4, dict(parallel=dict(pipeline=dict(size=4, partition="parameters")))),
    "dp2-pp2": (4, dict(parallel=dict(pipeline=2))),
    "dp2-pp2-interleaved": (4, dict(parallel=dict(pipeline=dict(size=2, num_chunks=2)))),
    "pp2-fixed-shape": (2, dict(parallel=dict(pipeline=dict(size=2, tensor_shape=(1, 3, 8))))),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_equals_dense(name):
    world, config = LAYOUTS[name]
    config = dict(config, num_microbatches=MICRO)
    pipeline = config["parallel"]["pipeline"]
    p = pipeline if isinstance(pipeline, int) else pipeline["size"]
    dp = world // p
    data = batches(STEPS, MICRO * dp)
    dense_losses, dense_sd, dense_grads = train_dense(data)
    results = run_distributed(_train_pipeline, world, data, config=config, timeout=300)
    for rank, (losses, full, _grads, info) in enumerate(results):
        # every stage reports the last stage's loss (broadcast), so logs agree across stages
        assert losses == results[rank - rank % p][0], (rank, losses)
        assert set(full) == set(dense_sd), "full state dict has the dense keys"
        for key, t in dense_sd.items():
            # fp32; micro-batching only changes the summation order of the gradients
            torch.testing.assert_close(full[key], t, atol=1e-5, rtol=1e-5, msg=f"{name} {key}")
        assert info["schedule"] == (
            "InterleavedPipelineSchedule" if "interleaved" in name else "PipelineSchedule"
        )
        assert info["optimizer_groups"][0]["weight_decay"] == 0.01, "group settings kept"
        assert info["optimizer_groups"][1]["lr"] == 0.05
    # the global-batch loss is the mean of the data-parallel ranks' losses
    dp_losses = torch.tensor([results[d * p][0] for d in range(dp)]).mean(0)
    torch.testing.assert_close(dp_losses, torch.tensor(dense_losses), atol=1e-5, rtol=1e-5)
    # evaluation after training: the last stage's outputs are the dense model's
    model = dense_model()
    model.load_state_dict(dense_sd)
    x, y = data[0]
    with torch.no_grad():
        logits = model(x)
    for d in range(dp):
        out, label, eval_loss = results[d * p + p - 1][3]["eval"]
        # fp32, micro-batched forward: reordering only
        torch.testing.assert_close(out, data_slice_rows(logits, d, dp), atol=1e-5, rtol=1e-5)
        assert torch.equal(label, data_slice_rows(y, d, dp))
        assert results[d * p][3]["eval"][0] is None, "no outputs on the first stage"
        assert results[d * p][3]["eval"][2] == eval_loss, "the eval loss reaches every stage"
    first, last = results[0][3], results[p - 1][3]
    assert first["shared"] == ["0.weight"] and last["shared"] == [f"{9}.weight"]
    assert "PipelineSharedModuleGradientHandler" in first["handlers"], "default with tied weights"
    if dp == 1:  # first-step gradients before any reduction: each stage's share of the dense ones
        stage_grads = [r[2] for r in results]
        for key, g in dense_grads.items():
            if key == "0.weight":  # the tied pair: embedding use on the first stage + head use
                got = stage_grads[0]["0.weight"] + stage_grads[p - 1]["9.weight"]
            else:
                (got,) = [sg[key] for sg in stage_grads if key in sg]
            # micro-batch sums vs one batch: fp32 reordering only
            torch.testing.assert_close(got, g, atol=1e-6, rtol=1e-5, msg=f"grad {key}")


def test_uniform_and_parameter_partitions_differ():
    """pp4 uniform cuts 10 layers 3/3/2/2; 'parameters' balances the heavy ends (emb/head)."""
    cfgs = {
        m: dict(parallel=dict(pipeline=dict(size=4, partition=m)), num_microbatches=4)
        for m in ("uniform", "parameters")
    }
    data = batches(1, 4)
    chunks = {
        m: [r[3]["chunks"] for r in run_distributed(_train_pipeline, 4, data, config=c)]
        for m, c in cfgs.items()
    }
    assert chunks["uniform"] == [[["0", "1", "2"]], [["3", "4", "5"]], [["6", "7"]], [["8", "9"]]]
    # emb 128, linears 72 each, tanh 0, head 16 (+128 tied): the optimum puts emb alone
    assert chunks["parameters"][0] == [["0"]]
    assert chunks["parameters"] != chunks["uniform"]


def test_lazy_model_on_meta_trains_like_dense():
    """pp2 x interleaved from a meta-device model: weights loaded after initialize."""
    config = dict(parallel=dict(pipeline=dict(size=2, num_chunks=2)), num_microbatches=MICRO)
    data = batches(STEPS, MICRO)
    dense_losses, dense_sd, _ = train_dense(data)
    results = run_distributed(_train_pipeline, 2, data, True, config=config, timeout=300)
    for losses, full, _, _ in results:
        # fp32; micro-batching only reorders the gradient sums
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(dense_losses), atol=1e-5, rtol=1e-5
        )
        for key, t in dense_sd.items():
            torch.testing.assert_close(full[key], t, atol=1e-5, rtol=1e-5, msg=key)


def test_dp2_tp2_pp2_equals_dense():
    config = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")), num_microbatches=MICRO)
    data = batches(STEPS, MICRO * 2)
    dense_losses, dense_sd, _ = train_dense(data)
    results = run_distributed(_train_pipeline, 8, data, config=config, timeout=300)
    for _losses, full, _, _ in results:
        for key, t in dense_sd.items():
            # fp32; tensor-parallel partial sums and micro-batching reorder additions
            torch.testing.assert_close(full[key], t, atol=1e-5, rtol=1e-5, msg=key)
    p, t = 2, 2
    dp_losses = torch.tensor([results[d * p * t][0] for d in range(2)]).mean(0)
    torch.testing.assert_close(dp_losses, torch.tensor(dense_losses), atol=1e-5, rtol=1e-5)


ENGINE_FEATURES = {
    # name: (config, batches, accumulation, clip, tolerance and its reason)
    "accumulation2-clip": (
        dict(parallel=dict(pipeline=2), gradient_accumulation=2, clip_grad_norm=0.05),
        6,
        2,
        0.05,
        1e-5,  # fp32: summation order only; the clip is active (the dense norm is > 0.05)
    ),
    "naive-fp16-interleaved": (
        dict(
            parallel=dict(pipeline=dict(size=2, num_chunks=2)),
            fp16=dict(mode="naive", initial_scale=2**8),
        ),
        3,
        1,
        0.0,
        5e-3,  # fp16 forward/backward (eps 1e-3) on weights of size ~0.3, fp32 masters
    ),
    "bf16": (dict(parallel=dict(pipeline=2), fp16=dict(mode="bf16")), 3, 1, 0.0, 3e-2),
    # bf16 autocast keeps 8 mantissa bits (eps 8e-3); fp32 weights
}


@pytest.mark.parametrize("name", list(ENGINE_FEATURES))
def test_pipeline_with_engine_features_equals_dense(name):
    config, n, accumulation, clip, tol = ENGINE_FEATURES[name]
    config = dict(config, num_microbatches=MICRO)
    data = batches(n, MICRO)
    dense_losses, dense_sd, _ = train_dense(data, clip=clip, accumulation=accumulation)
    results = run_distributed(_train_pipeline, 2, data, config=config, timeout=300)
    for losses, full, _, _ in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(dense_losses), atol=tol, rtol=0
        )
        for key, t in dense_sd.items():
            torch.testing.assert_close(full[key].float(), t, atol=tol, rtol=0, msg=f"{name} {key}")
