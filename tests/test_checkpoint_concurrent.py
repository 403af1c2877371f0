"""A reader that loads a checkpoint while another process overwrites it gets the old save or the
new one: never a mix of the two, never an error, and every rank the same one.

A separate process saves the same path over and over, each save with every weight equal to its
epoch; two ranks load it again and again meanwhile.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import forked
from helpers.harness import free_port, run_distributed

import gridtrain as gt

TIMEOUT = 300
LOADS = 40


def _saver(path: str, sharded: bool, port: int, ready) -> None:
    """The saving process: one rank of its own, saving ``path`` until it is killed; ``ready``
    is set after the first save."""
    gt.launch({}, 0, 1, "127.0.0.1", port, backend="gloo")
    model = _model()
    epoch = 0
    while True:
        epoch += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(epoch)
        gt.save_checkpoint(path, epoch, model, sharded=sharded)
        if epoch == 1:
            ready.set()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def _reader(ctx, path: str, loads: int):
    model = _model()
    seen = []
    for _ in range(loads):
        epoch = gt.load_checkpoint(path, model)
        values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique()
        seen.append((epoch, values.tolist()))
    return seen


@pytest.mark.parametrize("fmt", ["sharded", "dense"])
def test_a_load_during_overwrites_gets_one_whole_save(tmp_path, fmt):
    path = tmp_path / ("ckpt" if fmt == "sharded" else "ckpt.pt")
    # a separate process forked from the harness's server (torch and gridtrain imported once)
    ctx = forked.context()
    ready = ctx.Event()
    saver = ctx.Process(target=_saver, args=(str(path), fmt == "sharded", free_port(), ready))
    saver.start()
    try:
        assert ready.wait(TIMEOUT), "the saver's first save"
        time.sleep(0.2)
        per_rank = run_distributed(_reader, 2, str(path), LOADS, timeout=TIMEOUT)
        assert saver.is_alive(), "the saver kept saving throughout"
    finally:
        saver.kill()
        saver.join()
    epochs = [[e for e, _ in seen] for seen in per_rank]
    assert epochs[0] == epochs[1], "every rank loaded the same save"
    assert len(set(epochs[0])) > 1, "control: the loads really overlapped saves"
    for epoch, values in per_rank[0] + per_rank[1]:
        assert values == [float(epoch)], f"a mix of saves: epoch {epoch}, values {values[:5]}"
