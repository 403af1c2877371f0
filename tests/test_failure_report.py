"""What `gridtrain run` prints when a job fails: the first error once, one line per other rank
(issue 27, one error once), and in a hang the rank that never arrived (issue 28 item 9).

torch's own ``ProcessFailure`` objects are built from error files written the way the workers
write them (``failure_record.error_record`` of real exceptions), so the summary is checked on what
the agent really receives; tests/test_launch_run.py runs the whole path on real processes.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import gridtrain as gt
from gridtrain.cli import failures
from gridtrain.failure_record import error_record

PlanError = gt.PlanError


def _raised(exc: BaseException):
    try:
        raise exc
    except BaseException:  # noqa: BLE001 - captured as the excepthook would receive it
        return sys.exc_info()


def _failure(tmp: Path, rank: int, exitcode: int, exc=None, printed=False) -> ProcessFailure:
    path = tmp / f"error_{rank}.json"
    if exc is not None:
        path.write_text(json.dumps(error_record(*_raised(exc), printed=printed)))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def _stack(report: Path, rank: int, text: str) -> None:
    (report / "attempt_0").mkdir(parents=True, exist_ok=True)
    (report / "attempt_0" / f"rank_{rank}.stack").write_text(text)


PLAN = "tensor mode '2d' cannot shard ['0.weight']"


def test_the_same_error_on_every_rank_is_told_once(tmp_path):
    got = {r: _failure(tmp_path, r, 1, PlanError(PLAN)) for r in range(4)}
    text = failures.summarize(got, tmp_path / "report")
    lines = text.splitlines()
    assert lines[0] == f"rank 0 failed: PlanError: {PLAN}", text
    assert text.count(PLAN) == 1 and text.count("Traceback") == 1, text
    assert lines[-3:] == [f"rank {r}: failed with the same error" for r in (1, 2, 3)], text


def test_an_error_a_worker_printed_is_not_printed_again(tmp_path):
    got = {r: _failure(tmp_path, r, 1, PlanError(PLAN), printed=r == 2) for r in range(4)}
    text = failures.summarize(got, tmp_path / "report")
    assert PLAN not in text and "Traceback" not in text, text
    assert text.splitlines() == [f"rank {r}: failed with the same error" for r in (0, 1, 3)]


def test_a_lost_connection_and_a_stopped_rank_are_one_line_each(tmp_path):
    report = tmp_path / "report"
    _stack(report, 2, 'Current thread 0x1 (most recent call first):\n  File "job.py", line 3\n')
    got = {
        0: _failure(tmp_path, 0, 1, RuntimeError("Connection closed by peer [127.0.0.1]:5")),
        1: _failure(tmp_path, 1, 1, ValueError("boom")),
    }
    lines = failures.summarize(got, report).splitlines()
    assert lines[0] == "rank 1 failed: ValueError: boom", lines
    assert lines[-2:] == [
        "rank 0: stopped after rank 1 failed",
        "rank 2: stopped after rank 1 failed",
    ]


def test_a_crash_names_the_signal(tmp_path):
    got = {0: _failure(tmp_path, 0, -signal.SIGSEGV), 1: _failure(tmp_path, 1, -signal.SIGTERM)}
    lines = failures.summarize(got, tmp_path / "report").splitlines()
    assert lines == ["rank 0 was killed by SIGSEGV", "rank 1: stopped after rank 0 failed"]


def test_ranks_that_exit_with_their_own_code_add_nothing(tmp_path):
    """A demo that misses --target_f1 prints its verdict and exits 1 on every rank: that line
    stays the last one."""
    got = {r: _failure(tmp_path, r, 1) for r in range(3)}
    got[3] = _failure(tmp_path, 3, -signal.SIGTERM)  # stopped by the agent after rank 0 exited
    assert failures.summarize(got, tmp_path / "report") == ""
    got[1] = _failure(tmp_path, 1, 1, ValueError("boom"))
    assert failures.summarize(got, tmp_path / "report").startswith("rank 1 failed: ValueError")


WAITING = """Thread 0x2 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x1 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 40 in step
"""
STUCK = """Current thread 0x1 (most recent call first):
  File "/job/data.py", line 12 in next_batch
  File "/job/train.py", line 38 in step
"""


def test_a_hang_names_the_rank_that_did_not_arrive_with_its_stack(tmp_path):
    """Rank 0 timed out first; rank 1 was waiting too (stopped in all_reduce); rank 2 never
    came: it is the one to look at, not rank 0."""
    report = tmp_path / "report"
    _stack(report, 1, WAITING)
    _stack(report, 2, STUCK)
    timeout = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    got = {0: _failure(tmp_path, 0, 1, timeout), 1: _failure(tmp_path, 1, -signal.SIGTERM)}
    lines = failures.summarize(got, report).splitlines()
    assert lines[0].startswith("rank 2 did not arrive: rank 0 timed out waiting for it"), lines
    assert lines[1:3] == [
        '  File "/job/data.py", line 12 in next_batch',
        '  File "/job/train.py", line 38 in step',
    ], "rank 2's main-thread stack"
    assert lines[3:] == ["rank 1: was waiting in a collective"], lines
