"""torch's gloo worker threads, waited for until idle before a process ends.

A gloo worker that drops the last reference to a collective's tensor after the interpreter
has begun to shut down needs the GIL; Python then ends that thread with ``pthread_exit``
inside a noexcept C++ frame ("terminate called without an active exception", SIGABRT), and
a finished job exits 1. A process group still held by Python objects (the context, an
engine's gradient buckets) keeps its workers until those objects go, so the workers are
waited for, not joined: by ``gridtrain.destroy()`` and at interpreter exit.
"""

from __future__ import annotations

import logging
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
logger = logging.getLogger("gridtrain")


def _gloo_workers() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """{thread id: (state, context-switch counts)} of this process's gloo worker threads (Linux
    /proc; {} elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{base}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"{base}/status") as f:
                switches = tuple(line for line in f if "ctxt_switches" in line)
        except (OSError, IndexError):
            continue  # the thread has just ended
        out[tid] = (state, switches)
    return out


def wait_for_idle_workers(timeout_s: float = 30.0, settle_s: float = 0.02) -> bool:
    """Wait until every gloo worker thread sleeps and stays asleep for ``settle_s``.

    The sleep between looks releases the GIL, so a worker waiting for it runs
    and is seen to (its state or its context-switch counts change); a worker
    preempted after completing a collective, before releasing it, is runnable.
    Returns False if some worker was still busy after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = _gloo_workers()
        if now == last and all(state == b"S" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            logger.warning("gloo worker threads still busy after %.0fs: %s", timeout_s, now)
            return False
        last = now
        time.sleep(settle_s)
