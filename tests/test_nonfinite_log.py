"""The non-finite warning names the window's true step, once (issue 28 item 9, the smaller part).

Two steps in a row with a NaN loss on one rank: each is skipped on every rank and reported by
one rank, naming its own step (skipped steps do not advance ``global_step``, so counting by it
named the first bad step twice). The deferred check (CUDA's: read a step late) says the same.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.harness import run_distributed
from helpers.logs import gridtrain_warnings
from torch import nn

import gridtrain as gt

BAD = (2, 3)


def _warnings(ctx, defer):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=defer)
    engine, *_ = gt.initialize(model, opt, nn.MSELoss())
    engine.nonfinite.defer = defer
    with gridtrain_warnings() as messages:
        g = torch.Generator().manual_seed(1)
        for step in range(6):
            engine.zero_grad()
            loss = engine.criterion(engine(torch.randn(4, 4, generator=g)), torch.zeros(4, 1))
            if step in BAD and ctx.global_rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        engine.settle()
    return [m for m in messages if "non-finite" in m], engine.global_step


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_each_skipped_step_is_reported_once_with_its_own_step(defer):
    results = run_distributed(_warnings, 2, defer, config=dict(max_nonfinite_steps=0))
    (rank0, steps0), (rank1, steps1) = results
    assert steps0 == steps1 == 6 - len(BAD), "both bad steps were skipped"
    assert rank1 == [], "one rank reports for all"
    named = [int(re.search(r"step (\d+)", m).group(1)) for m in rank0]
    assert named == list(BAD), rank0
