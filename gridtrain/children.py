"""The processes a training process starts die with it (Linux), as it dies with its launcher.

``gridtrain run`` starts every worker so that the kernel kills it when the launcher dies
(``cli/procs.die_with_parent``), even by SIGKILL. A worker's own children (DataLoader workers)
were not covered: after ``kill -9`` of the launcher's group they lived on for about 30 s,
until torch's watchdog noticed. Two ways in, both asking the kernel for SIGKILL when the
parent dies (``PR_SET_PDEATHSIG``):

- ``install`` (``launch_from_torch``): every child forked from the main thread, any DataLoader
  of the default ``fork`` start method included. Only the main thread: the signal follows the
  forking *thread*, so a child forked by a short-lived thread would die with that thread;
- ``WorkerInit``, the ``worker_init_fn`` of ``gt.data.get_dataloader``'s workers, whatever
  their start method.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
_STATE = {"installed": False, "parent": 0, "main": False}


def set_parent_death_signal(parent: int | None = None) -> None:
    """Ask the kernel for SIGKILL when this process's parent dies (Linux; else nothing). If
    the parent (``parent``, or init's adoption) is already gone, exit: no signal would come."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):
        os._exit(1)


class WorkerInit:
    """A DataLoader ``worker_init_fn``: the parent-death signal, then ``then`` (the user's
    own, if any). Picklable where ``then`` is (spawned workers)."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        set_parent_death_signal()
        if self.then is not None:
            self.then(worker_id)


def _before() -> None:
    _STATE["parent"] = os.getpid()
    _STATE["main"] = threading.current_thread() is threading.main_thread()


def _in_child() -> None:
    if _STATE["main"]:
        set_parent_death_signal(_STATE["parent"])


def install() -> None:
    """From now on, children forked from the main thread get SIGKILL when this process dies.
    Linux only; calling it again does nothing."""
    if _STATE["installed"] or not sys.platform.startswith("linux"):
        return
    _STATE["installed"] = True
    os.register_at_fork(before=_before, after_in_child=_in_child)


__all__ = ["WorkerInit", "install", "set_parent_death_signal"]
