"""A tensor mode is one folder and one registry line: a toy mode added so trains like 1d.

``helpers/toy_mode`` is a mode package as the README's "Adding a tensor mode" describes it
(a torch-free ``geometry.py`` and a ``runtime.py``); each rank registers it with
``gridtrain.parallel.tensor.modes.register_mode`` and launches a config naming it. The
config accepts the name, the topology builds its groups from its geometry, the engine plans
the README's tiny LM with its layers and trains it: losses equal one plain process's, and
each rank holds about half of the weights (a replicated run would hold all of them).
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_lm
from helpers.harness import run_distributed
from helpers.runs import data_rows, engine_step, global_losses, param_share, reference_run

import gridtrain as gt
from gridtrain.parallel.tensor import modes

STEPS = 3
CONFIG = dict(parallel=dict(tensor=dict(size=2, mode="toy1d")))


def _train(rank: int, world: int, port: int, batches) -> dict:
    from helpers.toy_mode.geometry import GEOMETRY

    modes.register_mode(GEOMETRY)  # the one line that adds the mode
    try:
        ctx = gt.launch(CONFIG, rank, world, "127.0.0.1", port, backend="gloo")
        model = tiny_lm.build_model(0)
        opt, sched = tiny_lm.optimizer_and_scheduler(model)
        engine, *_ = gt.initialize(model, opt, tiny_lm.lm_loss, lr_scheduler=sched)
        losses = [engine_step(engine, *data_rows(b, ctx), ctx) for b in batches]
        state = gt.full_state_dict(engine.model)  # collective: every rank gathers
        out = dict(
            mode=ctx.tensor_mode,
            group=ctx.ranks(gt.ParallelMode.PARALLEL_1D),
            losses=losses,
            share=param_share(engine, tiny_lm.dense_numel()),
            plan=str(engine.plan),
            state=state if rank == 0 else None,
        )
        gt.destroy()
        return out
    finally:
        modes.unregister_mode("toy1d")


@pytest.fixture(scope="module")
def runs():
    batches = tiny_lm.batches(STEPS)
    ref = reference_run(
        tiny_lm.build_model, batches, tiny_lm.lm_loss, tiny_lm.optimizer_and_scheduler
    )
    return ref, run_distributed(_train, 2, batches, launch=False)


def test_unregistered_name_is_refused():
    with pytest.raises(
        gt.ConfigError, match="Input should be '1d', '2d', '2.5d', '3d' or 'sequence'"
    ):
        gt.Config.from_dict(CONFIG)


def test_toy_mode_trains_like_one_process(runs):
    ref, ranks = runs
    assert [r["mode"] for r in ranks] == ["toy1d", "toy1d"]
    assert [r["group"] for r in ranks] == [(0, 1), (0, 1)]  # its geometry's one group
    assert "ColumnLinear" in ranks[0]["plan"]  # planned with the runtime half's layers
    # float64 model, the same batches: only summation order differs from the reference
    losses = global_losses([r["losses"] for r in ranks])
    torch.testing.assert_close(losses, ref.losses, rtol=1e-9, atol=1e-9)
    for key, value in ranks[0]["state"].items():  # the weights after every step, likewise
        torch.testing.assert_close(value, ref.state[key], rtol=1e-9, atol=1e-9, msg=key)
    # tiny_lm's norms and row-parallel biases stay whole: at most their share above 1/2
    for r in ranks:
        assert 0.5 <= r["share"] <= 0.5 + 448 / 8640 + 1e-9
