"""How a failed job is told: the first error once, one line for every other rank.

``summarize`` (run by ``gridtrain.cli.agent`` when the job has failed) reads what each rank
recorded (``gridtrain.failure_record``) and writes one line for each rank but the first to
fail ("rank 3: stopped after rank 0 failed"). A job that ended in a timeout names the rank(s)
that never arrived, with the stack each was stuck in, instead of the rank that was only
waiting for them. A rank that could not take the launcher's SIGTERM (stopped by SIGSTOP, or
killed after the wait: ``gridtrain.cli.unresponsive``) is named as such, not as killed by
SIGKILL.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridtrain.cli.unresponsive import FROZEN, KILLED

CRASHES = {"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGKILL"}
# frames of a rank waiting for its peers: torch's collectives, and gridtrain's wrappers of them
WAITING = ("torch/distributed/", "gridtrain/parallel/comm.py")
HELD = ("frozen", "unresponsive")  # ends the launcher caused: it found the rank unable to stop


@dataclass
class RankEnd:
    """How one rank ended: ``kind`` is error, crash, timeout, peer, exit, stopped, frozen
    (it was stopped by SIGSTOP) or unresponsive (the launcher killed it after its SIGTERM wait)."""

    rank: int
    kind: str
    stamp: int
    what: str = ""  # "Type: message", "SIGSEGV", "code 3"
    traceback: str = ""
    printed: bool = False  # the worker printed it itself


def _end_of(rank: int, failure: Any) -> RankEnd:
    """A torch ``ProcessFailure`` as a ``RankEnd``."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    ours = data.get("gridtrain")
    if isinstance(ours, dict):
        return RankEnd(
            rank,
            ours["cause"],
            failure.timestamp,
            f"{ours['type']}: {ours['text']}",
            ours["traceback"],
            ours["printed"],
        )
    message = data.get("message")
    if isinstance(message, dict):  # torch's own @record wrote it
        extra = message.get("extraInfo", {})
        return RankEnd(
            rank, "error", failure.timestamp, message["message"], extra.get("py_callstack", "")
        )
    if failure.exitcode < 0:
        name = failure.signal_name()
        return RankEnd(rank, "crash" if name in CRASHES else "stopped", failure.timestamp, name)
    return RankEnd(rank, "exit", failure.timestamp, f"code {failure.exitcode}")


def _last_attempt(report_dir: Path, suffix: str) -> dict[int, str]:
    """{rank: text} of the last attempt's ``rank_N<suffix>`` files."""
    attempts = sorted(report_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return {}
    out = {}
    for path in attempts[-1].glob(f"rank_*{suffix}"):
        out[int(path.name[len("rank_") : -len(suffix)])] = path.read_text(errors="replace")
    return out


def _stacks(report_dir: Path) -> dict[int, str]:
    """Each rank's SIGTERM (or crash) stack dump of the last attempt."""
    return _last_attempt(report_dir, ".stack")


def main_thread(dump: str) -> list[str]:
    """The main thread's frames (innermost first) in a faulthandler dump: the last thread it
    lists (CPython lists the newest thread first)."""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip()) if b]
    if not blocks:
        return []
    return [line.strip() for line in blocks[-1].splitlines()[1:] if line.strip()]


def _head(end: RankEnd, stacks: dict[int, str]) -> list[str]:
    """The root failure's own lines: its message first, then its traceback (or stack)."""
    if end.kind == "crash":
        frames = main_thread(stacks.get(end.rank, ""))
        where = [", most recent call first:", *(f"  {f}" for f in frames)] if frames else [""]
        return [f"rank {end.rank} was killed by {end.what}{where[0]}", *where[1:]]
    if end.kind == "exit":
        return [f"rank {end.rank} exited with {end.what}"]
    if end.kind in HELD:
        frames = main_thread(stacks.get(end.rank, ""))
        where = [", it was here, most recent call first:", *(f"  {f}" for f in frames)]
        return [f"rank {end.rank} {end.what}{where[0] if frames else ''}", *where[1:]]
    return [f"rank {end.rank} failed: {end.what}", end.traceback.rstrip()]


def _one_line(end: RankEnd, root: RankEnd) -> str:
    if end.kind in ("error", "timeout", "peer") and end.what == root.what:
        return f"rank {end.rank}: failed with the same error"
    if end.kind == "error":
        first = end.what.splitlines()[0] if end.what else ""
        return f"rank {end.rank}: failed too: {first[:200]}"
    if end.kind == "crash":
        return f"rank {end.rank}: was killed by {end.what}"
    if end.kind == "exit":
        return f"rank {end.rank}: exited with {end.what}"
    if end.kind in HELD:
        return f"rank {end.rank}: {end.what}"
    if root.kind in HELD:
        if end.kind == "timeout":
            return f"rank {end.rank}: timed out waiting for it (timeout_s)"
        return f"rank {end.rank}: stopped after rank {root.rank} stopped responding"
    verb = "exited" if root.kind == "exit" else "failed"
    return f"rank {end.rank}: stopped after rank {root.rank} {verb}"


def _hang(ends: dict[int, RankEnd], stacks: dict[int, str]) -> list[str] | None:
    """The report of a collective that timed out: who never arrived, and where it was."""
    waited = sorted(e.rank for e in ends.values() if e.kind == "timeout")
    frames = {r: main_thread(stacks.get(r, "")) for r in ends}
    absent = [
        r
        for r in sorted(ends)
        if ends[r].kind == "stopped" and frames[r] and not any(w in frames[r][0] for w in WAITING)
    ]
    if not waited or not absent:
        return None
    first = absent[0]
    lines = [
        f"rank {first} did not arrive: rank {waited[0]} timed out waiting for it (timeout_s); "
        f"rank {first} was here, most recent call first:",
        *(f"  {frame}" for frame in frames[first]),
    ]
    for r in sorted(ends):
        if r in (first, waited[0]):
            continue
        if r in absent:
            lines.append(f"rank {r}: did not arrive either; it was at {frames[r][0]}")
        elif r in waited:
            lines.append(f"rank {r}: timed out waiting too")
        else:
            lines.append(f"rank {r}: was waiting in a collective")
    return lines


def _unresponsive(ends: dict[int, RankEnd], report_dir: Path) -> None:
    """Mark the ranks the launcher found stopped, or killed after its SIGTERM wait, in ``ends``:
    their SIGTERM or SIGKILL was the launcher's doing, not their failure."""
    for r, seconds in _last_attempt(report_dir, KILLED).items():
        ends[r] = RankEnd(
            r,
            "unresponsive",
            ends[r].stamp if r in ends else int(time.time()),
            f"did not respond to the launcher's SIGTERM for {seconds} s and was killed by it",
        )
    for r in _last_attempt(report_dir, FROZEN):
        ends[r] = RankEnd(
            r,
            "frozen",
            ends[r].stamp if r in ends else int(time.time()),
            "was stopped (SIGSTOP, Ctrl-Z or a debugger: process state T) and did not respond; "
            "the launcher resumed it to end the job",
        )


def summarize(failures: dict[int, Any], report_dir: Path) -> str:
    """The failed job's report: ``failures`` from torch's ``ChildFailedError``, stacks from
    ``report_dir``. Empty when the ranks that failed exited with a code of their own choosing
    (the script said why) and the others were only stopped."""
    stacks = _stacks(report_dir)
    ends = {r: _end_of(r, f) for r, f in failures.items()}
    for r in stacks:  # alive when the agent stopped the job
        ends.setdefault(r, RankEnd(r, "stopped", int(time.time()), "SIGTERM"))
    _unresponsive(ends, report_dir)
    # the error a worker printed first, else the earliest (torch's timestamps: whole seconds)
    by_time = sorted(ends.values(), key=lambda e: (not e.printed, e.stamp, e.rank))
    real = [e for e in by_time if e.kind in ("error", "crash")]
    held = [e for e in sorted(ends.values(), key=lambda e: e.rank) if e.kind in HELD]
    if not real and held:  # the others failed waiting for it: it is the cause
        real = held
    if not real:
        hang = _hang(ends, stacks)
        if hang is not None:
            return "\n".join(hang)
        kinds = {e.kind for e in ends.values()}
        if "exit" in kinds and kinds <= {"exit", "stopped"}:
            return ""  # the script chose its exit code (and said why); the rest were stopped
    root = (real or [e for e in by_time if e.kind != "stopped"] or by_time)[0]
    lines = [] if root.printed else _head(root, stacks)
    lines += [_one_line(ends[r], root) for r in sorted(ends) if r != root.rank]
    return "\n".join(lines)
