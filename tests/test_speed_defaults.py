"""The speed keys' defaults (``gridtrain.engine.speed``): what a config without ``compile``,
``attention`` and ``fused_optimizer`` gets on each device, and the parts that run on the CPU.

* What a CUDA device gets is read from ``resolve_speed`` against a device argument (and a
  compute capability), with no GPU: tests/gpu checks that a CUDA run really does it.
* On the CPU a config without the keys runs exactly as one that switches all three off:
  nothing compiled, the optimizer as built, the same losses and weights bit for bit.
* The fused switch gives the kernels the constructor's ``fused=True`` gives, bit for bit,
  and stays off where torch has no kernel (fused SGD on FSDP2's DTensors) or the user chose.
* A block torch.compile cannot build runs eagerly after one warning naming it; a user's
  error under compile is raised as eager raises it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.harness import run_distributed
from helpers.logs import gridtrain_warnings
from helpers.runs import dense_lm_loss, engine_run, global_losses, reference_run, token_batches
from helpers.tiny_lm import build_model, lm_loss, optimizer_and_scheduler

import gridtrain as gt
from gridtrain.engine import Trainer
from gridtrain.engine.fused_optimizer import use_fused_kernels
from gridtrain.engine.speed import resolve_speed

OFF = dict(compile=False, attention=False, fused_optimizer=False)
BATCHES = token_batches(3, 8, 8, 64, seed=1)


# ---- resolution: what each device gets ----------------------------------------------------------
def test_an_unset_config_is_fast_on_cuda_and_unchanged_on_the_cpu():
    cfg = gt.Config.from_dict({})
    cpu = resolve_speed(cfg, "cpu")
    assert (cpu.compile, cpu.attention, cpu.fused_optimizer) == (None, None, False)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("inductor's CUDA kernels need Triton, which is not installed here")
    hopper = resolve_speed(cfg, "cuda", capability=(9, 0))
    assert hopper.compile == gt.config.CompileConfig(), "what compile=True (the fast config) is"
    assert hopper.attention.backends == ["cudnn", "flash", "efficient", "math"]
    assert hopper.fused_optimizer
    ampere = resolve_speed(cfg, "cuda", capability=(8, 0))
    assert ampere.compile == gt.config.CompileConfig() and ampere.fused_optimizer
    assert ampere.attention is None, "below Hopper torch's own order starts with flash"
    pascal = resolve_speed(cfg, "cuda", capability=(6, 1))
    assert pascal.compile is None, "Triton needs compute capability 7.0"


def test_explicit_keys_win_on_every_device():
    off = resolve_speed(gt.Config.from_dict(OFF), "cuda", capability=(9, 0))
    assert (off.compile, off.attention, off.fused_optimizer) == (None, None, False)
    on = gt.Config.from_dict(
        dict(compile=dict(backend="aot_eager"), attention=dict(backends=["math"]))
    )
    cpu = resolve_speed(on.model_copy(update=dict(fused_optimizer=True)), "cpu")
    assert cpu.compile.backend == "aot_eager" and cpu.attention.backends == ["math"]
    assert cpu.fused_optimizer
    assert resolve_speed(gt.Config.from_dict(dict(compile=True)), "cpu").compile is not None


def test_the_keys_take_false_and_name_the_allowed_values():
    cfg = gt.Config.from_dict(OFF)
    assert (cfg.compile, cfg.attention, cfg.fused_optimizer) == (False, False, False)
    for key in ("compile", "attention", "fused_optimizer"):
        with pytest.raises(gt.ConfigError, match=key):
            gt.Config.from_dict({key: "yes"})
    with pytest.raises(gt.ConfigError, match="compile"):
        gt.Config.from_dict(dict(compile=1))


# ---- the CPU default changes nothing ----------------------------------------------------------
def _train(ctx, batches):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def probe(engine):
        groups = [(g["fused"], g["foreach"]) for g in engine.optimizer.param_groups]
        return engine.speed, groups

    run = engine_run(ctx, build_model, batches, lm_loss, optimizer_and_scheduler, probe=probe)
    return run, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_cpu_default_compiles_nothing_and_trains_bit_for_bit_as_all_off():
    (default, graphs), *_ = run_distributed(_train, 1, BATCHES, config={})
    (off, _), *_ = run_distributed(_train, 1, BATCHES, config=OFF)
    speed, groups = default.probed
    assert graphs == 0 and speed.compiled == [] and speed.compile is None
    assert speed.attention is None and speed.optimizer == "as built"
    assert groups == [(None, None)], "the optimizer's kernels are torch's choice, untouched"
    assert default.losses == off.losses, "bit for bit"
    for key, value in default.state.items():
        torch.testing.assert_close(value, off.state[key], rtol=0, atol=0, msg=key)


# ---- the fused switch -------------------------------------------------------------------------
def _params(seed: int = 0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(torch.optim.AdamW, {}), (torch.optim.Adam, {}), (torch.optim.SGD, dict(momentum=0.9))],
)
def test_switching_gives_the_constructors_fused_kernels_bit_for_bit(cls, kw):
    switched_params, built_params = _params(), _params()
    switched = cls(switched_params, lr=0.1, **kw)
    assert use_fused_kernels(switched, torch.device("cpu")) == "fused"
    assert switched._step_supports_amp_scaling, "GradScaler may hand it found_inf"
    built = cls(built_params, lr=0.1, fused=True, **kw)
    for step in range(3):
        for a, b in zip(switched_params, built_params, strict=True):
            a.grad = b.grad = torch.randn_like(a, generator=torch.Generator().manual_seed(step))
        switched.step()
        built.step()
    for a, b in zip(switched_params, built_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_switch_leaves_what_it_cannot_or_may_not_change():
    cpu = torch.device("cpu")
    said = {
        "foreach given": torch.optim.AdamW(_params(), foreach=False),
        "fused given": torch.optim.AdamW(_params(), fused=False),
        "other class": torch.optim.Adagrad(_params()),
        "other device": torch.optim.AdamW(_params()),
    }
    assert "fused or foreach was given" in use_fused_kernels(said["foreach given"], cpu)
    assert "fused or foreach was given" in use_fused_kernels(said["fused given"], cpu)
    assert "Adagrad has no fused kernel" in use_fused_kernels(said["other class"], cpu)
    why = use_fused_kernels(said["other device"], torch.device("cuda"))
    assert why == "as built: a parameter lives on cpu, not cuda"
    for opt in said.values():
        assert not opt.param_groups[0]["fused"]


def _zero3(ctx, batches, cls):
    def make(model):
        return (
            cls(model.parameters(), lr=1e-2)
            if cls is torch.optim.AdamW
            else cls(model.parameters(), lr=0.1, momentum=0.9)
        )

    run = engine_run(ctx, build_model, batches, lm_loss, make, probe=lambda e: e.speed.optimizer)
    return run


def test_fsdp2_dtensors_take_fused_adamw_but_not_fused_sgd():
    config = dict(zero=dict(stage=3), fused_optimizer=True)
    adamw = run_distributed(_zero3, 2, BATCHES, torch.optim.AdamW, config=config)
    sgd = run_distributed(_zero3, 2, BATCHES[:1], torch.optim.SGD, config=config)
    assert adamw[0].probed == "fused"
    assert sgd[0].probed == "as built: fused SGD takes no DTensor"

    def make(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2)

    ref = reference_run(build_model, BATCHES, dense_lm_loss, make)
    # float64; fused AdamW orders its arithmetic differently from the for-loop (~1e-16)
    torch.testing.assert_close(global_losses(adamw), ref.losses, rtol=1e-9, atol=1e-9)
    for key, value in adamw[0].state.items():
        torch.testing.assert_close(value, ref.state[key], rtol=1e-9, atol=1e-9, msg=key)


# ---- compile: fallback, user errors, the first step's compile time ------------------------------
def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here (the test's backend)")


def _fallback(ctx, batches):
    torch._dynamo.reset()
    torch._dynamo.register_backend(_failing_backend, name="gt_test_fails")
    with gridtrain_warnings() as warned:
        run = engine_run(ctx, build_model, batches, lm_loss, optimizer_and_scheduler)
    return run, warned


def test_a_block_that_fails_to_compile_runs_eagerly_after_one_warning():
    config = dict(compile=dict(backend="gt_test_fails", per_block=True, loss=False))
    ((run, warned),) = run_distributed(_fallback, 1, BATCHES, config=config)
    ((eager, _),) = run_distributed(_train, 1, BATCHES, config=OFF)
    failed = [w for w in warned if "torch.compile failed" in w]
    assert len(failed) == 2, warned  # one per block, over three steps
    assert "block 'blocks.0'" in failed[0] and "block 'blocks.1'" in failed[1]
    assert "no compiler here" in failed[0], "the warning says why"
    assert run.losses == eager.losses, "eager after the failure: bit for bit"


def _user_error(ctx):
    torch._dynamo.reset()
    model = build_model()
    engine, *_ = gt.initialize(model, optimizer_and_scheduler(model)[0], lm_loss)
    ids = torch.randint(0, 64, (2, 8))
    with gridtrain_warnings() as warned:
        try:
            engine(ids.double())  # an embedding takes integer ids: eager refuses it too
        except Exception as err:  # noqa: BLE001 - its type is the point
            raised = (type(err).__module__, type(err).__name__, str(err))
        out = engine(ids)  # the model still runs compiled afterwards
    return raised, warned, tuple(out.shape), engine.speed.compiled


def test_a_users_error_under_compile_is_raised_as_eager_raises_it():
    config = dict(compile=dict(backend="aot_eager"))
    ((raised, warned, shape, compiled),) = run_distributed(_user_error, 1, config=config)
    module, name, message = raised
    assert not module.startswith("torch._dynamo"), raised
    assert name == "RuntimeError" and "Long" in message, raised
    assert warned == [], "not a compile failure: nothing to warn about"
    assert shape == (2, 8, 64) and compiled == ["", "criterion"]


def _fit(ctx, batches):
    model = build_model()
    engine, *_ = gt.initialize(model, optimizer_and_scheduler(model)[0], lm_loss)
    data = [(x, y) for x, y in batches]
    trainer = Trainer(engine)
    trainer.fit(data, epochs=1)
    return trainer.compile_s


def test_the_first_steps_compile_time_is_reported():
    compiled = run_distributed(_fit, 1, BATCHES, config=dict(compile=dict(backend="aot_eager")))
    eager = run_distributed(_fit, 1, BATCHES, config={})
    assert compiled[0] > 0, "seconds torch.compile took in the first step"
    assert eager[0] is None, "nothing compiled: nothing to report"
