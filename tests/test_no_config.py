"""No config file at all: ``python train.py`` and ``gridtrain run train.py`` train with the
defaults (data parallelism over every process), and the job says so once."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import forked
from test_launch_run import gridtrain_command

from gridtrain.config import CONFIG_ENV
from gridtrain.launch import DEFAULTS_NOTICE

TRAIN = """
import torch
import torch.distributed as dist

import gridtrain as gt

ctx = gt.launch_from_torch()
model = torch.nn.Linear(4, 2)
engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())
engine.train()
engine.zero_grad()
engine.backward(engine.criterion(engine(torch.ones(2, 4)), torch.zeros(2, 2)))
engine.step()
print(f"rank {ctx.global_rank} of {dist.get_world_size()} trained", flush=True)
gt.destroy()
"""


@pytest.fixture
def train(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def _run(argv: list[str], cwd) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(CONFIG_ENV, None)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_python_train_py_runs_one_process_with_the_defaults(train):
    # `python train.py`, forked from the test pool's server (torch imported once)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(CONFIG_ENV, None)
    proc = forked.run(["train.py"], train, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "rank 0 of 1 trained" in out, out
    assert out.count(DEFAULTS_NOTICE) == 1, out


def test_gridtrain_run_without_config_runs_every_rank_with_the_defaults(train):
    out = _run([*gridtrain_command(), "run", "--nproc_per_node", "2", "train.py"], train)
    assert "rank 0 of 2 trained" in out and "rank 1 of 2 trained" in out, out
    assert out.count(DEFAULTS_NOTICE) == 1, f"said once per job, not per rank:\n{out}"
