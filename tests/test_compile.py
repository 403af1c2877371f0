"""``compile``: each repeated block compiled (hooks and collectives outside the graphs) trains
exactly as eager under every kind of layout; ``attention`` selects SDPA's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from helpers.runs import (
    assert_grads_close,
    engine_run,
    global_losses,
    reference_run,
    seeded,
    token_batches,
)

import gridtrain as gt
from gridtrain.engine.compile import find_blocks

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 64
# aot_eager runs dynamo and AOTAutograd (graph capture, breaks, the joint backward) without
# generating C++: the engine's part of compiling, at a cost CI can pay for every layout
AOT = dict(compile=dict(backend="aot_eager"))
LAYOUTS = {
    "one process": (1, {}),
    "dp2": (2, {}),
    "1d2": (2, dict(parallel=dict(tensor=dict(size=2, mode="1d")))),
    "pp2": (2, dict(parallel=dict(pipeline=2), num_microbatches=2)),
    "dp2 zero2": (2, dict(zero=2)),  # stage 3 compiled: test_zero.py
}


def _loss(logits, labels):
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _model(dtype=torch.float64):
    return seeded(lambda: TinyTransformer(vocab=VOCAB, seq=SEQ), seed=0, dtype=dtype)


def _dense_loss(o, y):
    return F.cross_entropy(o.flatten(0, 1), y.flatten())


def _train(ctx, batches):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = engine_run(ctx, _model, batches, _loss, _adamw, example_inputs=batches[0][0])
    return run, torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_train_as_eager(name):
    world, parallel = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = reference_run(_model, batches, _dense_loss, _adamw)
    d_losses, d_final = ref.losses, ref.state
    results = run_distributed(_train, world, batches, config=dict(AOT, **parallel), timeout=300)
    data_parallel = name.startswith("dp")  # each rank's loss is over its half of the batch
    mean_losses = global_losses([run for run, _ in results])
    for rank, (run, graphs) in enumerate(results):
        losses, grads, final, held = run.losses, run.grads[0], run.state, run.shares
        assert graphs >= 1, f"{name}: nothing was compiled"
        # really cut, compiled or not: 1d halves every block matrix, pp keeps one stage
        if name == "1d2":
            mats = [k for k in held if k.startswith("blocks.") and k.endswith("weight")]
            mats = [k for k in mats if "ln" not in k]
            assert mats and all(held[k] == 0.5 for k in mats), (rank, held)
        if name == "pp2":  # a replica would hold every parameter of the model
            assert 0 < len(held) < len(d_final), (rank, sorted(held))
        # float64: AOTAutograd's decompositions and sharding only reorder sums
        got = mean_losses if data_parallel else losses
        assert got == pytest.approx(d_losses, rel=1e-10), (name, rank)
        assert_grads_close(grads, ref, msg=name, rtol=1e-8, atol=1e-12)
        for k, v in final.items():  # AdamW on near-zero gradients amplifies rounding
            torch.testing.assert_close(v, d_final[k], rtol=1e-4, atol=1e-8, msg=f"{name} {k}")


def _fp32_model():
    return _model(torch.float32)


def _train_fp32(ctx, batches):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # compile_threads=1: inductor compiles in this process, not a pool of workers it starts
    # (and imports torch in) for a couple of C++ files on a 2-core machine
    patch = dict(force_disable_caches=True, compile_threads=1)  # codegen runs every time
    with torch._inductor.config.patch(**patch):
        run = engine_run(ctx, _fp32_model, batches, _loss, _adamw)
    return run.losses, run.state, dict(torch._dynamo.utils.counters["stats"])


def test_inductor_blocks_match_eager_in_float32(tmp_path):
    """The default backend generates C++ for the blocks on CPU (one graph for both blocks);
    ``compile.options`` reach it (here: its trace, which writes the generated code)."""
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = reference_run(_fp32_model, batches, _dense_loss, _adamw)
    d_losses, d_final = ref.losses, ref.state
    trace = {"trace.enabled": True, "trace.debug_dir": str(tmp_path)}
    ((losses, final, stats),) = run_distributed(
        _train_fp32, 1, batches, config=dict(compile=dict(options=trace, loss=False)), timeout=600
    )
    assert stats["unique_graphs"] >= 1, stats
    assert list(tmp_path.rglob("output_code.py")), "compile.options never reached inductor"
    # float32: inductor fuses and reorders reductions (~1e-6 relative per op)
    assert losses == pytest.approx(d_losses, rel=1e-4)
    for k, v in final.items():
        if k.endswith("k.bias"):  # its true gradient is 0 (softmax ignores it): AdamW's
            continue  # step there is lr * sign(rounding noise), different in every kernel
        torch.testing.assert_close(v, d_final[k], rtol=1e-3, atol=1e-5, msg=k)


def test_find_blocks_takes_the_repeated_list_only():
    model = TinyTransformer(layers=3)
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    assert find_blocks(mlp) == [], "lone layers are not blocks: the model compiles whole"
    seq = torch.nn.Sequential(*TinyTransformer(layers=2).pipeline_layers())  # as demos/gpt
    assert [n for n, _ in find_blocks(seq)] == ["1", "2"]


def _kernels(ctx):
    """Which SDPA kernels a forward under the engine may use (torch's global flags)."""

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            self.seen = (
                torch.backends.cuda.math_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
            )
            return self.lin(x)

    probe = Probe()
    engine, *_ = gt.initialize(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
    engine(torch.zeros(1, 2))
    return probe.seen, (
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
    )


def test_attention_backends_hold_inside_the_forward_only():
    ((inside, after),) = run_distributed(
        _kernels, 1, config=dict(attention=dict(backends=["math"])), timeout=120
    )
    assert inside == (True, False), "only the math kernel is allowed in the forward"
    assert after == (True, True), "torch's defaults are back after it"


def test_bad_compile_and_attention_keys_name_the_allowed_values():
    with pytest.raises(gt.ConfigError, match="mode"):
        gt.Config.from_dict(dict(compile=dict(mode="fast")))
    with pytest.raises(gt.ConfigError, match="cudnn"):
        gt.Config.from_dict(dict(attention=dict(backends=["cudn"])))
    with pytest.raises(gt.ConfigError, match="did you mean 'coordinate_descent_tuning'"):
        gt.Config.from_dict(dict(compile=dict(options={"coordinate_descent_tunning": True})))
    hyphens = gt.Config.from_dict(dict(compile=dict(options={"coordinate-descent-tuning": 1})))
    assert hyphens.compile.options, "torch.compile reads 'a-b' as 'a_b': so does the check"
    with pytest.raises(gt.ConfigError, match="compile.mode .* and compile.options"):
        gt.Config.from_dict(dict(compile=dict(mode="max-autotune", options={"max_autotune": 1})))


def test_the_criterion_is_compiled_unless_it_holds_collectives():
    from types import SimpleNamespace

    from gridtrain.engine.compile import compile_criterion, compiled_by_gridtrain

    options = gt.Config.from_dict(dict(compile=dict(backend="aot_eager"))).compile
    plain = SimpleNamespace(tensor_mode=None, config=SimpleNamespace(chunked_loss=None))
    loss = torch.nn.CrossEntropyLoss()
    assert compile_criterion(loss, options, plain) is loss, "a module keeps its identity"
    assert compiled_by_gridtrain(loss), "its forward is compiled"
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0])
    assert loss(x, y).item() == pytest.approx(F.cross_entropy(x, y).item(), rel=1e-12)
    fn = compile_criterion(_loss, options, plain)
    assert fn is not _loss and fn(x, y).item() == pytest.approx(_loss(x, y).item(), rel=1e-12)
    sharded = SimpleNamespace(tensor_mode="1d", config=plain.config)
    kept = torch.nn.CrossEntropyLoss()
    assert not compiled_by_gridtrain(compile_criterion(kept, options, sharded))
    off = gt.Config.from_dict(dict(compile=dict(loss=False))).compile
    assert compile_criterion(_loss, off, plain) is _loss
