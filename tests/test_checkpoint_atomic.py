"""A save killed with SIGKILL at a random moment leaves the previous checkpoint loadable.

A process of its own saves the same path over and over (sharded: synchronous and asynchronous saves
alternating, so directories are replaced while the old one is live; dense: a file); the test
kills it at a random moment of a save, several times. Every time, the checkpoint at the path
loads and holds the weights, and after the next save no temporary is left in the directory.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import forked
from helpers.harness import free_port, run_distributed

import gridtrain as gt

TIMEOUT = 300
TRIES = 4


def _save_forever(path: str, fmt: str, port: int, ready) -> None:
    """The saver, a process of its own: one save, its duration to ``ready``, then the same path
    saved over and over (sharded: synchronous and asynchronous saves alternating)."""
    gt.launch({}, 0, 1, "127.0.0.1", port, backend="gloo")
    model, opt = _model_and_opt(0)
    sharded = fmt != "dense"
    start = time.perf_counter()
    gt.save_checkpoint(path, 1, model, opt, sharded=sharded)
    ready.send(time.perf_counter() - start)
    epoch = 1
    while True:
        epoch += 1
        handle = gt.save_checkpoint(
            path, epoch, model, opt, sharded=sharded, async_save=sharded and epoch % 2 == 0
        )
        if handle is not None:
            handle.wait()


def _model_and_opt(seed: int):
    """Two 512 x 512 layers (~4 MB of state with Adam): a save takes long enough to hit."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    return model, opt


def _load_then_save_again(ctx, path, sharded):
    want, _ = _model_and_opt(0)
    model, opt = _model_and_opt(1)  # other weights: they must come from the file
    epoch = gt.load_checkpoint(path, model, opt)
    same = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values())
    )
    gt.save_checkpoint(path, epoch + 1, model, opt, sharded=sharded)  # the next save
    return epoch, same


def _hidden(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


@pytest.mark.parametrize("fmt", ["sharded", "dense"])
def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, fmt):
    rng = random.Random(1234)
    directory = tmp_path / "ckpts"
    path = directory / ("ckpt" if fmt == "sharded" else "ckpt.pt")
    mid_save = 0
    for attempt in range(TRIES):
        # forked from the test pool's server (torch and gridtrain imported): a real process
        ctx = forked.context()
        ready, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_save_forever, args=(str(path), fmt, free_port(), send))
        proc.start()
        send.close()
        try:
            assert ready.poll(TIMEOUT), "the saver never finished its first save"
            # a random moment in the second to fifth save
            time.sleep(rng.uniform(1.0, 4.0) * ready.recv())
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        left = _hidden(directory)
        mid_save += bool(left)
        epoch, same = run_distributed(
            _load_then_save_again, 1, str(path), fmt != "dense", timeout=TIMEOUT
        )[0]
        assert epoch >= 1 and same, (attempt, epoch)
        assert _hidden(directory) == [], f"attempt {attempt}: left behind {_hidden(directory)}"
        assert os.listdir(directory) == [path.name]
    print(f"{fmt}: {TRIES} kills, {mid_save} left a temporary that the next save removed")
