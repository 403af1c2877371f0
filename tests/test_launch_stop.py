"""Stopping a job as people do: Ctrl-C prints one line for the job (not every rank's
KeyboardInterrupt traceback), and ends it promptly even while a rank waits in the rendezvous;
``kill -9`` of the launcher's group leaves no DataLoader worker behind; ``gridtrain --version``. Each launch is one
2-rank job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_launch_run import finish, gridtrain_command, job_dir, processes_in, start, wait_for_line

from gridtrain.cli.main import main

__all__ = ["job_dir"]  # the fixture

WITH_WORKERS = """
ctx = gt.launch_from_torch(backend="gloo")
loader = torch.utils.data.DataLoader(list(range(10**6)), batch_size=1, num_workers=1)
batches = iter(loader)
next(batches)  # the worker process is up
say(f"pid {os.getpid()} training")
while True:  # a job that would train forever
    next(batches)
    dist.all_reduce(torch.ones(4))
    time.sleep(0.05)
"""


def test_ctrl_c_prints_one_line_for_the_job(job_dir):
    proc = start(job_dir, WITH_WORKERS)
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid"})
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the foreground group
    code, out = finish(proc, timeout=120)
    assert code == 128 + signal.SIGINT, "".join(lines) + out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines() == ["stopped by SIGINT; every worker was stopped"], out


def test_kill_9_of_the_launchers_group_takes_the_dataloader_workers_too(job_dir):
    proc = start(job_dir, WITH_WORKERS)
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid"})
    # launcher, agent, 2 ranks and their DataLoader workers (the pdeathsig wrapper execs)
    assert len(processes_in(job_dir)) >= 6, processes_in(job_dir)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5  # torch's own watchdog took ~30 s
    while processes_in(job_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_in(job_dir) == [], "a DataLoader worker outlived its training process"


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("gridtrain 0."), "the installed version"
    out = subprocess.run([*gridtrain_command(), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("gridtrain "), out


IN_RENDEZVOUS = """
if os.environ["RANK"] == "1":
    time.sleep(120)  # late: rank 0 waits for it inside the rendezvous (C++)
say("waiting in the rendezvous")
gt.launch_from_torch(backend="gloo")
"""


def test_ctrl_c_during_the_rendezvous_ends_the_job_at_once(job_dir):
    proc = start(job_dir, IN_RENDEZVOUS)
    wait_for_line(proc, [], {"rank 0 waiting"})
    time.sleep(1.0)
    began = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=120)
    took = time.monotonic() - began
    assert code == 128 + signal.SIGINT, out
    assert took < 15, f"took {took:.1f} s to stop (it was 31.8 s: SIGINT, then SIGKILL at 30 s)"
    assert "Traceback" not in out, out


LOADER = """
import os, sys, time
import gridtrain as gt

class Pids:
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        return os.getpid()

batches = iter(gt.data.get_dataloader(Pids(), 1, num_workers=1))
print(int(next(batches)[0]), flush=True)
time.sleep(600)
"""


def test_a_get_dataloader_worker_dies_with_its_process(tmp_path):
    """Without gridtrain run: the loader's own worker_init_fn sets the parent-death signal."""
    proc = subprocess.Popen([sys.executable, "-c", LOADER], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    assert worker != proc.pid and os.path.exists(f"/proc/{worker}")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 2  # torch's watchdog looks every 5 s
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the DataLoader worker outlived its process"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


FROZEN = """
ctx = gt.launch_from_torch(backend="gloo")
say(f"pid {os.getpid()} training")
while True:
    dist.all_reduce(torch.ones(4))
    time.sleep(0.05)
"""


def test_a_frozen_rank_is_reported_as_stopped_not_killed(job_dir):
    """Issue 33 item 9: a rank frozen by SIGSTOP (Ctrl-Z, a debugger) makes rank 0 time out;
    the report says rank 1 was stopped, not that something killed it by SIGKILL (torch's
    agent waits 30 s for it to take SIGTERM, then kills it)."""
    proc = start(job_dir, FROZEN, "timeout_s = 5\n")
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid"})
    pid = next(int(line.split()[3]) for line in lines if line.startswith("rank 1 pid"))
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    code, out = finish(proc, timeout=120)
    took = time.monotonic() - began
    assert code == 1, out
    assert out.startswith("rank 1 was stopped (SIGSTOP"), out
    assert "rank 0: timed out waiting for it" in out, out
    assert "SIGKILL" not in out, out
    assert took < 25, f"{took:.1f} s: timeout_s is 5, then no 30 s wait for a SIGKILL"
