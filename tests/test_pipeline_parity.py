"""Pipeline schedules on gloo processes equal the dense model trained on the whole batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout, pick
from helpers.models import LMLoss, tied_lm, two_groups
from helpers.runs import (
    Ints,
    assert_grads_close,
    batches,
    data_rows,
    engine_run,
    global_losses,
    reference_run,
)

import gridtrain as gt

STEPS, MICRO, VOCAB, SEQ = 3, 8, 16, 3


def _data(steps: int, batch: int) -> list:
    return batches(steps, Ints(VOCAB, (batch, SEQ)), Ints(VOCAB, (batch, SEQ)))


def _dense_model():
    """The reference weights (seed 0)."""
    torch.manual_seed(0)
    return tied_lm()


def _sgd(model):
    return torch.optim.SGD(two_groups(model), lr=0.1, momentum=0.9)


def _reference(data, clip: float = 0.0):
    return reference_run(_dense_model, data, LMLoss(), _sgd, clip=clip)


def _assert_a_stage_each(results, name=""):
    """Each rank holds only its stages' layers: fewer parameter elements than the dense
    model (432: embedding 128, four Linears of 72, head bias 16; a stage holding the head
    also counts its copy of the tied embedding), which a full replica on every rank holds."""
    dense = sum(p.numel() for p in _dense_model().parameters())
    for rank, run in enumerate(results):
        assert 0 < run.held < dense, (name, rank, run.held, dense)


def _stage_info(ctx, data):
    """After training: a forward-only pass (outputs and labels on the last stage), the
    parameters this stage holds, its handlers, schedule, optimizer groups and stage table."""

    def probe(engine):
        engine.eval()
        out, label, loss = engine.execute_schedule(
            iter([data_rows(data[0], ctx)]), forward_only=True
        )
        return dict(
            eval=(out, label, loss.item()),
            names=[n for n, _ in engine.model.named_parameters()],
            handlers=[type(h).__name__ for h in engine.gradient_handlers],
            schedule=type(engine.schedule).__name__,
            optimizer_groups=[
                {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                for g in engine.optimizer.param_groups
            ],
            stages=_stage_layers(str(engine.plan)),
        )

    return probe


def _stage_layers(plan: str) -> list[str]:
    """The 'layers' column of the plan's pipeline stage table, one entry per stage."""
    lines = plan.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "layers"])
    return [line.split()[1] for line in lines[head + 1 :] if line.split()[:1] != []]


def _train_pipeline(ctx, data, lazy: bool = False):
    """Train from the dense model's weights (loaded into another init before
    ``gt.initialize``, or into a ``gt.lazy_init`` model after it)."""

    def build():
        torch.manual_seed(123)  # a different init: the loaded state dict defines the weights
        with gt.lazy_init() if lazy else contextlib.nullcontext():
            model = tied_lm()
        if not lazy:
            gt.load_full_state_dict(model, _dense_model().state_dict())
        return model

    example = data_rows(data[0][0], ctx)  # traced on meta when a tensor mode needs a plan
    load = _dense_model().state_dict() if lazy else None
    probe = _stage_info(ctx, data)
    return engine_run(
        ctx, build, data, LMLoss(), _sgd, probe=probe, load=load, example_inputs=example
    )


LAYOUTS = {
    "pp2-1f1b": layout("pp2"),
    "pp4-1f1b": layout("pp4"),
    **pick("pp2-interleaved", "pp4-interleaved"),
    "pp4-params-partition": (4, dict(parallel=dict(pipeline=dict(size=4, partition="parameters")))),
    **pick("dp2-pp2", "dp2-pp2-interleaved"),
    "pp2-fixed-shape": (2, dict(parallel=dict(pipeline=dict(size=2, tensor_shape=(1, 3, 8))))),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_equals_dense(name):
    world, config = LAYOUTS[name]
    config = dict(config, num_microbatches=MICRO)
    pipeline = config["parallel"]["pipeline"]
    p = pipeline if isinstance(pipeline, int) else pipeline["size"]
    dp = world // p
    data = _data(STEPS, MICRO * dp)
    ref = _reference(data)
    results = run_distributed(_train_pipeline, world, data, config=config, timeout=300)
    for rank, run in enumerate(results):
        info = run.probed
        # every stage reports the last stage's loss (broadcast), so logs agree across stages
        assert run.losses == results[rank - rank % p].losses, (rank, run.losses)
        assert set(run.state) == set(ref.state), "full state dict has the dense keys"
        for key, t in ref.state.items():
            # fp32; micro-batching only changes the summation order of the gradients
            torch.testing.assert_close(run.state[key], t, atol=1e-5, rtol=1e-5, msg=f"{name} {key}")
        # the first step's gradients as the optimizer applied them: the tied embedding and
        # head (on both stages) the sum of both uses; micro-batch sums vs one batch: fp32
        # reordering only
        assert_grads_close(run.grads[0], ref, msg=f"{name} rank {rank}", atol=1e-6, rtol=1e-5)
        assert info["schedule"] == (
            "InterleavedPipelineSchedule" if "interleaved" in name else "PipelineSchedule"
        )
        assert info["optimizer_groups"][0]["weight_decay"] == 0.01, "group settings kept"
        assert info["optimizer_groups"][1]["lr"] == 0.05
    # the global-batch loss is the mean of the data-parallel ranks' losses
    torch.testing.assert_close(
        torch.tensor(global_losses(results)), torch.tensor(ref.losses), atol=1e-5, rtol=1e-5
    )
    # evaluation after training: the last stage's outputs are the dense model's
    model = _dense_model()
    model.load_state_dict(ref.state)
    x, y = data[0]
    with torch.no_grad():
        logits = model(x)
    for d in range(dp):
        out, label, eval_loss = results[d * p + p - 1].probed["eval"]
        # fp32, micro-batched forward: reordering only
        torch.testing.assert_close(out, logits.chunk(dp)[d], atol=1e-5, rtol=1e-5)
        assert torch.equal(label, y.chunk(dp)[d])
        assert results[d * p].probed["eval"][0] is None, "no outputs on the first stage"
        assert results[d * p].probed["eval"][2] == eval_loss, "the eval loss reaches every stage"
    first, last = results[0].probed, results[p - 1].probed
    # the tied pair: the embedding on the first stage, its copy in the head on the last
    assert "0.weight" in first["names"] and "9.weight" in last["names"]
    assert "PipelineSharedModuleGradientHandler" in first["handlers"], "default with tied weights"


def test_uniform_and_parameter_partitions_differ():
    """pp4 uniform cuts 10 layers 3/3/2/2; 'parameters' balances the heavy ends (emb/head)."""
    cfgs = {
        m: dict(parallel=dict(pipeline=dict(size=4, partition=m)), num_microbatches=4)
        for m in ("uniform", "parameters")
    }
    data = _data(1, 4)
    stages = {
        m: run_distributed(_train_pipeline, 4, data, config=c)[0].probed["stages"]
        for m, c in cfgs.items()
    }
    assert stages["uniform"] == ["0-2", "3-5", "6-7", "8-9"]
    # emb 128, linears 72 each, tanh 0, head 16 (+128 tied): the optimum puts emb alone
    assert stages["parameters"][0] == "0"
    assert stages["parameters"] != stages["uniform"]


def test_lazy_model_on_meta_trains_like_dense():
    """pp2 x interleaved from a meta-device model: weights loaded after initialize."""
    config = dict(parallel=dict(pipeline=dict(size=2, num_chunks=2)), num_microbatches=MICRO)
    data = _data(STEPS, MICRO)
    ref = _reference(data)
    results = run_distributed(_train_pipeline, 2, data, True, config=config, timeout=300)
    _assert_a_stage_each(results, "lazy")
    for run in results:
        # fp32; micro-batching only reorders the gradient sums
        torch.testing.assert_close(
            torch.tensor(run.losses), torch.tensor(ref.losses), atol=1e-5, rtol=1e-5
        )
        for key, t in ref.state.items():
            torch.testing.assert_close(run.state[key], t, atol=1e-5, rtol=1e-5, msg=key)


def test_dp2_tp2_pp2_equals_dense():
    config = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")), num_microbatches=MICRO)
    data = _data(STEPS, MICRO * 2)
    ref = _reference(data)
    results = run_distributed(_train_pipeline, 8, data, config=config, timeout=300)
    for run in results:
        for key, t in ref.state.items():
            # fp32; tensor-parallel partial sums and micro-batching reorder additions
            torch.testing.assert_close(run.state[key], t, atol=1e-5, rtol=1e-5, msg=key)
    first_stage = [run.shares["1.weight"] for run in results if "1.weight" in run.shares]
    assert first_stage == [0.5] * 4, "the first stage's ranks each hold half of its Linear"
    torch.testing.assert_close(
        torch.tensor(global_losses(results)), torch.tensor(ref.losses), atol=1e-5, rtol=1e-5
    )


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
    # each optimizer step: ``accumulation`` micro-steps of MICRO rows (their mean loss is the
    # whole window's), against one dense step on the window
    data = _data(n // accumulation, MICRO * accumulation)
    ref = _reference(data, clip=clip)
    if clip:
        assert min(ref.norms) > clip, "the clip is active"
    results = run_distributed(_train_pipeline, 2, data, config=config, timeout=300)
    _assert_a_stage_each(results, name)
    for run in results:
        torch.testing.assert_close(
            torch.tensor(run.losses), torch.tensor(ref.losses), atol=tol, rtol=0
        )
        for key, t in ref.state.items():
            torch.testing.assert_close(
                run.state[key].float(), t, atol=tol, rtol=0, msg=f"{name} {key}"
            )
