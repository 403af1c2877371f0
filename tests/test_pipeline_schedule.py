"""``parallel.pipeline.schedule``: each schedule named in the config trains on gloo processes as
one plain process does, a combination it cannot run is a ConfigError at load, and a step that
raised midway leaves nothing behind for the next one."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import LMLoss, tied_lm
from helpers.runs import (
    Ints,
    batches,
    data_rows,
    engine_run,
    engine_step,
    global_losses,
    reference_run,
    seeded,
    start_engine,
)

import gridtrain as gt

VOCAB, SEQ, ROWS, MICRO = 16, 3, 8, 4
# float64: a pipeline only reorders the sums of the micro-batches' gradients
TOL = dict(atol=1e-12, rtol=1e-10)

SCHEDULES = {  # parallel.pipeline of each: the schedule named explicitly
    "1f1b": dict(size=2, schedule="1f1b"),
    "gpipe": dict(size=2, schedule="gpipe"),
    "interleaved": dict(size=2, num_chunks=2, schedule="interleaved"),
}


def _data(steps: int) -> list:
    return batches(steps, Ints(VOCAB, (ROWS, SEQ)), Ints(VOCAB, (ROWS, SEQ)))


def _model():
    return seeded(tied_lm)  # seed 0, float64


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _config(name: str) -> dict:
    return dict(parallel=dict(pipeline=SCHEDULES[name]), num_microbatches=MICRO)


def _dense_numel() -> int:
    return sum(p.numel() for p in _model().parameters())


# ---- the key at config load: no process is started -----------------------------------------
def _error(pipeline: dict, **rest) -> str:
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_dict(dict(parallel=dict(pipeline=pipeline), **rest))
    return str(err.value)


@pytest.mark.parametrize(
    "pipeline,need",
    [
        (dict(size=2, schedule="interleaved"), "num_chunks > 1"),
        (dict(size=2, schedule="interleaved", num_chunks=1), "num_chunks > 1"),
        (dict(size=2, schedule="1f1b", num_chunks=2), "num_chunks = 1"),
        (dict(size=2, schedule="gpipe", num_chunks=3), "num_chunks = 1"),
    ],
)
def test_a_schedule_that_cannot_run_the_chunks_is_a_config_error(pipeline, need):
    message = _error(pipeline, num_microbatches=4)
    assert "parallel.pipeline.schedule" in message and "parallel.pipeline.num_chunks" in message
    assert need in message and f"num_chunks={pipeline.get('num_chunks', 1)}" in message
    assert "1f1b, interleaved, gpipe" in message, "the allowed values are named"


def test_an_unknown_schedule_names_the_key_and_every_schedule_of_the_table():
    from gridtrain.config.pipeline import WARMUP
    from gridtrain.engine.schedules import SCHEDULES as TABLE

    message = _error(dict(size=2, schedule="zero-bubble"))
    assert "parallel.pipeline.schedule" in message and "'zero-bubble'" in message
    for name in TABLE:  # the config accepts exactly the engine's table
        assert f"'{name}'" in message
    assert set(TABLE) == set(SCHEDULES) == set(WARMUP)  # and each has its warm-up count


def test_only_the_interleaved_schedule_needs_microbatches_divisible_by_the_stages():
    message = _error(dict(size=4, num_chunks=2, schedule="interleaved"), num_microbatches=6)
    assert "num_microbatches 6 % pipeline 4 != 0" in message
    for name in ("1f1b", "gpipe"):  # a round per stage is the interleaved schedule's need only
        c = gt.Config.from_dict(
            dict(parallel=dict(pipeline=dict(size=4, schedule=name)), num_microbatches=6)
        )
        assert c.parallel.pipeline.schedule == name


# ---- each schedule against one process ------------------------------------------------------
def _probe(ctx, x):
    """After training: the schedule's name, and a forward-only pass (outputs on the last stage)."""

    def probe(engine):
        engine.eval()
        out, _, loss = engine.execute_schedule(iter([data_rows(x, ctx)]), forward_only=True)
        return engine.schedule.name, out, loss.item()

    return probe


def _train(ctx, data):
    probe = _probe(ctx, data[0])
    return engine_run(ctx, _model, data, LMLoss(), _sgd, probe=probe)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_schedule_trains_as_one_process(name):
    data = _data(3)
    ref = reference_run(_model, data, LMLoss(), _sgd)
    results = run_distributed(_train, 2, data, config=_config(name), timeout=300)
    dense = _dense_numel()
    for rank, run in enumerate(results):
        assert 0 < run.held < dense, (rank, run.held, dense)  # a stage each, no replica
        for key, t in ref.state.items():
            torch.testing.assert_close(run.state[key], t, msg=f"{name} {key}", **TOL)
    assert [r.probed[0] for r in results] == [name, name], "the engine runs the named schedule"
    # every stage reports the last stage's loss (float64 mean of the micro-batches')
    torch.testing.assert_close(
        torch.tensor(global_losses(results)), torch.tensor(ref.losses), **TOL
    )
    model = _model()
    model.load_state_dict(ref.state)
    x, y = data[0]
    with torch.no_grad():
        logits = model(x)
    _, out, loss = results[1].probed
    torch.testing.assert_close(out, logits, **TOL)  # float64: micro-batching reorders nothing
    torch.testing.assert_close(loss, LMLoss()(logits, y).item(), **TOL)
    assert results[0].probed[1] is None, "no outputs on the first stage"


def test_without_the_key_the_chunks_pick_the_schedule():
    """Today's choice is the default: interleaved when num_chunks > 1, else 1f1b."""
    for pipeline, name in [(2, "1f1b"), (dict(size=2, num_chunks=2), "interleaved")]:
        c = gt.Config.from_dict(dict(parallel=dict(pipeline=pipeline), num_microbatches=4))
        assert c.parallel.pipeline.schedule is None
        assert c.parallel.pipeline.schedule_name == name


# ---- a step that raised midway ----------------------------------------------------------------
class Boom(RuntimeError):
    pass


# per stage, the forward (one micro-batch through one chunk, counted from 1) that raises: the
# first stage's after it sent its first activation(s), the last stage's before it sends
# anything back, so every message either side posted was received and no rank is left waiting
FAIL_AT = {"1f1b": (2, 1), "gpipe": (2, 1), "interleaved": (3, 2)}


def _fail_midway(ctx, data, fail_at):
    """Train on data[0], fail a step on data[1] midway, then train on data[2]."""
    engine, _ = start_engine(_model(), LMLoss(), _sgd)
    losses = [engine_step(engine, *data_rows(data[0], ctx), ctx)]
    calls = [0]

    def trap(module, args):
        calls[0] += 1
        if calls[0] == fail_at[ctx.local_rank(gt.ParallelMode.PIPELINE)]:
            raise Boom(f"forward {calls[0]}")

    handle = engine.model.register_forward_pre_hook(trap)
    engine.train()
    engine.zero_grad()
    with pytest.raises(Boom) as err:
        engine.execute_schedule(iter([data_rows(data[1], ctx)]), return_output_label=False)
    handle.remove()
    losses.append(engine_step(engine, *data_rows(data[2], ctx), ctx))
    return str(err.value), losses, gt.full_state_dict(engine.model)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_step_that_raised_midway_leaves_the_next_step_as_one_process(name):
    data = _data(3)
    ref = reference_run(_model, [data[0], data[2]], LMLoss(), _sgd)  # the failed batch: no step
    results = run_distributed(
        _fail_midway, 2, data, FAIL_AT[name], config=_config(name), timeout=300
    )
    assert [r[0] for r in results] == [f"forward {n}" for n in FAIL_AT[name]]
    torch.testing.assert_close(
        torch.tensor(global_losses([r[1] for r in results])), torch.tensor(ref.losses), **TOL
    )
    for _, _, state in results:
        for key, t in ref.state.items():
            torch.testing.assert_close(state[key], t, msg=f"{name} {key}", **TOL)
