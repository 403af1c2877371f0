"""Workers that cannot take the launcher's SIGTERM: stopped ones are resumed, killed ones noted.

torch's agent ends the workers with ``PContext.close``: from its poll loop once one has
failed, and on a signal. It sends SIGTERM, waits up to 30 s, then sends SIGKILL. A worker
stopped by SIGSTOP (Ctrl-Z, ``kill -STOP``; process state T) takes no signal but SIGKILL,
so it was killed 30 s later and the job's report said "rank 1 was killed by SIGKILL", as if
something outside had killed it. ``close_workers`` wraps ``close``:

- a stopped worker is noted (``rank_N.frozen`` in the attempt's report directory) and
  resumed (SIGCONT), so it takes the SIGTERM at once and dumps its stack;
- a worker that was running when the close began and ended by SIGKILL (it did not respond
  to SIGTERM within the wait: a debugger's stop, uninterruptible sleep, SIGTERM ignored) is
  noted as killed by the launcher (``rank_N.killed``, holding the seconds it was given).

``gridtrain.cli.failures`` reads both notes.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

FROZEN = ".frozen"  # rank_N.frozen: rank N was stopped (state T) when the launcher ended it
KILLED = ".killed"  # rank_N.killed: the launcher killed rank N after its SIGTERM wait


def close_workers(close, report_dir: Path):
    """``PContext.close`` that notes and resumes stopped workers and notes those it killed."""

    def wrapped(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        running: dict[int, int] = {}
        with contextlib.suppress(Exception):  # never in the way of stopping the workers
            running = _resume_stopped(self, report_dir)
        close(self, death_sig, timeout)
        with contextlib.suppress(Exception):
            _note_killed(self, running, report_dir, timeout)

    return wrapped


def _where(context, local_rank: int, report_dir: Path) -> tuple[Path, int]:
    """(this attempt's report directory, the global rank) of a worker of ``context``."""
    env = context.envs[local_rank]
    return report_dir / f"attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", int(env["RANK"])


def _resume_stopped(context, report_dir: Path) -> dict[int, int]:
    """SIGCONT to every stopped worker, noted; returns {local rank: pid} of the running ones."""
    running = {}
    for local_rank, pid in context.pids().items():
        state = _state(pid)
        if state is None:
            continue
        running[local_rank] = pid
        if state == "T":
            where, rank = _where(context, local_rank, report_dir)
            where.mkdir(parents=True, exist_ok=True)
            (where / f"rank_{rank}{FROZEN}").touch()
            os.kill(pid, signal.SIGCONT)
    return running


def _note_killed(context, running: dict[int, int], report_dir: Path, timeout: int) -> None:
    handlers = getattr(context, "subprocess_handlers", {})  # torch's SubprocessContext
    for local_rank in running:
        handler = handlers.get(local_rank)
        if handler is not None and handler.proc.returncode == -signal.SIGKILL:
            where, rank = _where(context, local_rank, report_dir)
            where.mkdir(parents=True, exist_ok=True)
            (where / f"rank_{rank}{KILLED}").write_text(str(timeout))


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (R, S, D, T, t, Z...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state
