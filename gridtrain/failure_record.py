"""What a rank records when it fails under torch's elastic agent, read by ``gridtrain run``.

``install`` (called by ``launch_from_torch``) writes an uncaught exception to torch's per-rank
error file (``TORCHELASTIC_ERROR_FILE``) in torch's format, plus what the agent's summary
(``gridtrain.cli.failures``) needs to sort it out. Under ``gridtrain run`` (``REPORT_DIR`` set
by its agent) only the first rank on the node to fail with an error of its own prints it, at
once: its message, then its traceback. A rank that failed because another did (a lost
connection, a collective that timed out) prints nothing, and SIGTERM (the agent stopping the
others) dumps every thread's stack to a file instead of the terminal.
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
from pathlib import Path
from typing import Any

REPORT_DIR = "GRIDTRAIN_REPORT_DIR"  # set by gridtrain.cli.agent for its workers
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
TIMEOUT = re.compile(r"timed out|watchdog caught collective operation timeout", re.I)
_KEEP: list[Any] = []  # the open stack-dump file must outlive install()


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
        if where is not None and issubclass(kind, KeyboardInterrupt):
            return  # gridtrain run passed on a Ctrl-C: the agent says so once for the job
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
    # whole or absent: the agent reads it (json.load, re-raised: gridtrain run died of a
    # JSONDecodeError) while it may be killing this process mid-write (SIGTERM after a peer's
    # failure), so write a temporary beside it and rename
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(error_record(kind, value, tb, printed), f)
    os.replace(temporary, path)
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
