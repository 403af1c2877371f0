"""A finished job exits 0: no "terminate called without an active exception" at interpreter exit.

torch's gloo worker threads release the last reference to a collective's
tensors after the collective has completed; if that happens once Python has
begun to shut down, taking the GIL ends the thread inside a noexcept C++ frame
and the process aborts (SIGABRT). The scripts below make the window wide and
deterministic: a completion callback keeps a worker busy for about a second
after ``wait()`` returned, and the group stays referenced past ``destroy()``
(as an engine's gradient buckets keep theirs). ``destroy()``, and an exit
without it, must wait for the workers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import free_port, run_distributed

import gridtrain as gt

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import gridtrain as gt

rank, port, call_destroy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
ctx = gt.launch({}, rank, 2, "127.0.0.1", port, backend="gloo")
keep = ctx.group(gt.ParallelMode.DATA)  # still referenced after destroy(), like engine buckets
fut = dist.all_reduce(torch.ones(4), group=keep, async_op=True).get_future()
busy = fut.then(lambda f: sum(range(3 * 10**7)))  # runs in the gloo worker thread
fut.wait()  # returns before the callback has run
del fut, busy
if call_destroy:
    gt.destroy()
print(f"rank {rank} done", flush=True)
"""


@pytest.mark.parametrize("call_destroy", [True, False], ids=["destroy", "no-destroy"])
def test_two_ranks_exit_0_while_a_gloo_worker_is_still_busy(tmp_path, call_destroy):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(gt.__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, "1" if call_destroy else "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert f"rank {rank} done" in out, out
        assert "terminate called" not in out, out
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out}"


def test_wait_for_idle_workers_without_gloo_threads_returns_at_once():
    from gridtrain.parallel.gloo_threads import _gloo_workers, wait_for_idle_workers

    assert _gloo_workers() == {} or all(len(v) == 2 for v in _gloo_workers().values())
    assert wait_for_idle_workers(timeout_s=5.0) is True


def _save_and_leave_it_in_flight(ctx, path):
    model = torch.nn.Linear(64, 64)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    future = gt.save_checkpoint(path, 1, engine.model, sharded=True, async_save=True)
    return future.done()  # not waited for: the harness's gt.destroy() must finish the save


def test_destroy_finishes_an_asynchronous_save_in_flight(tmp_path):
    """The checkpoint writer registers its wait with ``gt.destroy()``, which runs it before
    the process groups (which the background save uses) are destroyed."""
    path = tmp_path / "ckpt"
    done = run_distributed(_save_and_leave_it_in_flight, 2, str(path), timeout=120)
    assert gt.latest_checkpoint(tmp_path) == path, f"incomplete (done at return: {done})"
