"""How a failed job is told: the first error once, one line for every other rank.

Worker side (``install``, called by ``launch_from_torch``): an uncaught exception is written to
torch's per-rank error file (``TORCHELASTIC_ERROR_FILE``) with what gridtrain needs to sort it
out. Under ``gridtrain run`` (``REPORT_DIR`` set by ``gridtrain.agent``) only the first rank on
the node to fail with an error of its own prints it, at once: its message, then its traceback.
A rank that failed because another did (a lost connection, a collective that timed out) prints
nothing, and SIGTERM (the agent stopping the others) dumps every thread's stack to a file
instead of the terminal.

Agent side (``summarize``): when the job has failed, one line for each other rank ("rank 3:
stopped after rank 0 failed"). A job that ended in a timeout names the rank(s) that never
arrived, with the stack each was stuck in, instead of the rank that was only waiting for them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPORT_DIR = "GRIDTRAIN_REPORT_DIR"  # set by gridtrain.agent for its workers
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
TIMEOUT = re.compile(r"timed out|watchdog caught collective operation timeout", re.I)
CRASHES = {"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGKILL"}
# frames of a rank waiting for its peers: torch's collectives, and gridtrain's wrappers of them
WAITING = ("torch/distributed/", "gridtrain/parallel/comm.py")
_KEEP: list[Any] = []  # the open stack-dump file must outlive install()


# ---- worker side --------------------------------------------------------------------------------
def cause_of(kind: type, text: str) -> str:
    """'peer' (a peer went away), 'timeout' (a collective timed out) or 'error' (its own)."""
    if any(p in text for p in PEER_FAILURES):
        return "peer"
    if TIMEOUT.search(text) and (issubclass(kind, RuntimeError | TimeoutError | OSError)):
        return "timeout"
    return "error"


def attempt_dir() -> Path | None:
    """This worker's report directory for this attempt (under gridtrain run), else None."""
    root = os.environ.get(REPORT_DIR)
    if not root:
        return None
    path = Path(root) / f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def install() -> None:
    """Under torch's elastic agent: record uncaught exceptions (see the module docstring) and
    dump stacks on SIGTERM. Does nothing outside torchrun, or when called again."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or getattr(install, "done", False):
        return
    install.done = True
    where = attempt_dir()
    if where is None:  # plain torchrun: stacks to the terminal, tracebacks as usual
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    else:
        dump = open(where / f"rank_{os.environ.get('RANK', '0')}.stack", "w")  # noqa: SIM115
        _KEEP.append(dump)
        faulthandler.register(signal.SIGTERM, file=dump, all_threads=True, chain=True)
        faulthandler.enable(file=dump, all_threads=True)  # a crash in native code too
    previous = sys.excepthook

    def record(kind, value, tb):
        try:
            printed, filed = _report(kind, value, tb, where)
        except Exception:  # noqa: BLE001 - reporting must never hide the error itself
            printed, filed = False, False
        if where is None or not (printed or filed):  # else the agent's summary tells it
            previous(kind, value, tb)

    sys.excepthook = record


def traceback_lines(kind: type, value: BaseException, tb) -> str:
    """The traceback without its last line, the exception's message (which comes first)."""
    lines = traceback.format_exception(kind, value, tb)
    last = traceback.format_exception_only(kind, value)
    if lines[-len(last) :] == last:
        lines = lines[: -len(last)]
    return "".join(lines)


def _report(kind: type, value: BaseException, tb, where: Path | None) -> tuple[bool, bool]:
    """Print the error if it is the node's first of its own; write the error file. Returns
    whether it printed, and whether it wrote the file."""
    text = str(value)
    cause = cause_of(kind, text)
    rank = os.environ.get("RANK", "?")
    printed = False
    if where is not None and cause == "error" and _claim_first(where):
        sys.__stderr__.write(
            f"rank {rank} failed: {kind.__name__}: {text}\n{traceback_lines(kind, value, tb)}"
        )
        sys.__stderr__.flush()
        printed = True
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return printed, False
    with open(path, "w") as f:
        json.dump(error_record(kind, value, tb, printed), f)
    return printed, True


def error_record(kind: type, value: BaseException, tb, printed: bool = False) -> dict:
    """The error file's content: the format torch's ``ErrorHandler.record_exception`` writes
    (read by torch's agent), plus what ``summarize`` needs under the key ``gridtrain``."""
    text = str(value)
    cause = cause_of(kind, text)
    stamp = int(time.time())
    if cause != "error":
        # a consequence of another rank's failure: torch's agent names the failure with the
        # smallest timestamp (whole seconds) the root cause, so let the first one win a tie
        stamp += 1
    return {
        "message": {
            "message": f"{kind.__name__}: {text}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(stamp),
            },
        },
        "gridtrain": {
            "type": kind.__name__,
            "text": text,
            "traceback": traceback_lines(kind, value, tb),
            "cause": cause,
            "printed": printed,
        },
    }


def _claim_first(where: Path) -> bool:
    try:
        os.close(os.open(where / "first_error", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return False
    return True


# ---- agent side ---------------------------------------------------------------------------------
@dataclass
class RankEnd:
    """How one rank ended: ``kind`` is error, crash, timeout, peer, exit or stopped."""

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


def _stacks(report_dir: Path) -> dict[int, str]:
    """Each rank's SIGTERM (or crash) stack dump of the last attempt."""
    attempts = sorted(report_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return {}
    out = {}
    for path in attempts[-1].glob("rank_*.stack"):
        out[int(path.stem.split("_")[1])] = path.read_text(errors="replace")
    return out


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


def summarize(failures: dict[int, Any], report_dir: Path) -> str:
    """The failed job's report: ``failures`` from torch's ``ChildFailedError``, stacks from
    ``report_dir``. Empty when the ranks that failed exited with a code of their own choosing
    (the script said why) and the others were only stopped."""
    stacks = _stacks(report_dir)
    ends = {r: _end_of(r, f) for r, f in failures.items()}
    for r in stacks:  # alive when the agent stopped the job
        ends.setdefault(r, RankEnd(r, "stopped", int(time.time()), "SIGTERM"))
    # the error a worker printed first, else the earliest (torch's timestamps: whole seconds)
    by_time = sorted(ends.values(), key=lambda e: (not e.printed, e.stamp, e.rank))
    real = [e for e in by_time if e.kind in ("error", "crash")]
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
