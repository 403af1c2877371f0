"""Under a pipeline, ``engine(x)`` says to use ``engine.execute_schedule`` (it used to fail deep
inside with "not enough values to unpack" or a target out of bounds), and the README's loop,
one iterator per epoch and one ``execute_schedule`` per step, trains."""

from __future__ import annotations

import torch
from helpers.harness import run_distributed
from torch import nn

import gridtrain as gt


def _pipeline_loop(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    engine, *_ = gt.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    )
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    try:
        engine(x)
        error = None
    except RuntimeError as err:
        error = str(err)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    losses = []
    engine.train()
    for _ in range(2):  # epochs
        data_iter = iter(loader)
        for _ in range(len(loader)):  # steps
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(data_iter)
            engine.step()
            losses.append(loss.item())
    return error, losses


def test_engine_call_under_a_pipeline_says_to_use_execute_schedule():
    config = dict(parallel=dict(pipeline=2), num_microbatches=2)
    for error, losses in run_distributed(_pipeline_loop, 2, config=config):
        assert error is not None, "engine(x) under a pipeline must raise"
        assert "parallel.pipeline = 2" in error and "engine.execute_schedule(data_iter)" in error
        assert len(losses) == 4 and losses[-1] < losses[0], losses
