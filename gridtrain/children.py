"""The processes a training process forks die with it (Linux), as it dies with its launcher.

``gridtrain run`` starts every worker so that the kernel kills it when the launcher dies
(``cli/procs.die_with_parent``), even by SIGKILL. A worker's own children (DataLoader workers,
forked) were not covered: after ``kill -9`` of the launcher's group they lived on for about
30 s, until torch's watchdog noticed. ``install`` makes every child forked from the main
thread ask the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``). Only the main
thread: the signal follows the forking *thread*, so a child forked by a short-lived thread
would be killed when that thread ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
_STATE = {"installed": False, "parent": 0, "main": False}


def _before() -> None:
    _STATE["parent"] = os.getpid()
    _STATE["main"] = threading.current_thread() is threading.main_thread()


def _in_child() -> None:
    if not _STATE["main"]:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _STATE["parent"]:  # the parent died before prctl: no signal will come
        os._exit(1)


def install() -> None:
    """From now on, children forked from the main thread get SIGKILL when this process dies.
    Linux only; calling it again does nothing."""
    if _STATE["installed"] or not sys.platform.startswith("linux"):
        return
    _STATE["installed"] = True
    os.register_at_fork(before=_before, after_in_child=_in_child)


__all__ = ["install"]
