"""How the benchmarks start their rank processes: forked from one server process that
imported torch and gridtrain once (``forkserver`` with those modules preloaded), instead of
one fresh interpreter per rank that imports them again (several seconds each on a small
machine). Each rank is still a process of its own that starts from the same memory: the
server never runs a step, opens a device or initialises CUDA.
"""

from __future__ import annotations

import multiprocessing as mp

START = "forkserver"  # the start_method for torch.multiprocessing.start_processes
PRELOAD = ["torch", "gridtrain.adapters", "gridtrain.engine", "gridtrain.launch"]


def rank_context():
    """A multiprocessing context whose processes fork from the preloaded server."""
    ctx = mp.get_context(START)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
