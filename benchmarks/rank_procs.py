"""How the benchmarks start their rank processes without a fresh interpreter per rank (each
imports torch and gridtrain again: several seconds on a small machine).

Where this process can fork safely (Linux, no CUDA device, one thread: nothing a fork could
leave half-held), the ranks fork from it directly. Otherwise they fork from one server process
that imported torch and gridtrain once (``forkserver`` with those modules preloaded); starting
that server is itself a fresh interpreter's import, which a benchmark forked from an already
loaded process (the tests' ``helpers.forked``) would otherwise pay once per run. Either way
each rank is a process of its own, and none inherits an initialised CUDA.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

START = "forkserver"  # where forking this process is not safe (see ``rank_context``)
PRELOAD = ["torch", "gridtrain.adapters", "gridtrain.engine", "gridtrain.launch"]


def _one_thread() -> bool:
    """Whether this process runs a single OS thread (no native pool, no gloo, no CUDA)."""
    with open("/proc/self/status") as f:
        return any(line.split() == ["Threads:", "1"] for line in f)


def rank_context():
    """A multiprocessing context for the ranks: ``fork`` where forking this process is as safe
    as forking the preloaded server (Linux, no CUDA device, one thread), else the forkserver.
    Start processes with ``start_method=ctx.get_start_method()``."""
    import torch

    if sys.platform == "linux" and not torch.cuda.is_available() and _one_thread():
        return mp.get_context("fork")
    ctx = mp.get_context(START)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
