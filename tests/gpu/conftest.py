"""One-GPU tests (``make test-gpu``): the CUDA paths checked against references in each test.

Every test here runs in this pytest process on one device, inside a one-rank gridtrain
context (``gt.launch`` at world size 1: NCCL on CUDA, so the engine takes its NCCL paths).
Without CUDA every test is reported as skipped (exit status 0), so ``make test`` stays green
on a machine without a GPU. ``GT_TEST_DEVICE=cpu`` runs the same bodies on the CPU with
gloo (bf16 where the CPU has it), to debug the tests' own logic without a GPU::

    GT_TEST_DEVICE=cpu python -m pytest -q tests/gpu
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from gpu_env import DEVICE_ENV, ON_CUDA


@pytest.fixture(autouse=True)
def _needs_device():
    if ON_CUDA and not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (set {DEVICE_ENV}=cpu to run these on the CPU)")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")


@pytest.fixture
def launch():
    """``launch(config)``: a one-rank gridtrain context on the test device (NCCL on CUDA,
    gloo on the CPU), destroyed when the test ends, whatever happens."""
    from helpers.harness import free_port

    import gridtrain as gt

    with contextlib.ExitStack() as stack:

        def start(config: dict | None = None):
            backend = "nccl" if ON_CUDA else "gloo"
            ctx = gt.launch(config or {}, 0, 1, "127.0.0.1", free_port(), backend=backend)
            stack.callback(gt.destroy)
            return ctx

        yield start
