"""`gridtrain run` on real processes: a loopback-only store, signals reaching every worker, a stuck
or failing rank ending the job with its traceback, and restarts by torch's elastic agent.

Each test starts a 2-rank job through the real command line (torch.distributed.run underneath).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.harness import free_port

from gridtrain.launch import CONFIG_ENV

PRELUDE = """
import os, sys, time
import torch
import torch.distributed as dist
import gridtrain as gt

def say(text):
    sys.stdout.write(f"rank {os.environ['RANK']} {text}\\n")
    sys.stdout.flush()
"""


def gridtrain_command() -> list[str]:
    script = Path(sys.executable).parent / "gridtrain"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gridtrain.cli"]


def start(
    tmp_path: Path,
    body: str,
    config: str = "",
    *options: str,
    port: bool = True,
    prefork: str | None = None,
) -> subprocess.Popen:
    """Start `gridtrain run --nproc_per_node 2 [options] --config config.py job.py` in tmp_path
    (with `--master_port` a free port unless ``port`` is False: then the launcher picks one;
    ``prefork``: GRIDTRAIN_PREFORK for the launcher, else unset: its default)."""
    for name, text in (("config.py", config), ("job.py", PRELUDE + body)):
        path = tmp_path / name
        if not path.is_file() or path.read_text() != text:  # a job started there may read it
            path.write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(CONFIG_ENV, None)
    env.pop("GRIDTRAIN_PREFORK", None)
    if prefork is not None:
        env["GRIDTRAIN_PREFORK"] = prefork
    if prefork is not None:
        env.pop("OMP_NUM_THREADS")  # torchrun's own default (1 for 2 ranks) must reach them
    chosen = ["--master_port", str(free_port())] if port else []
    argv = ["run", "--nproc_per_node", "2", *chosen, *options]
    return subprocess.Popen(
        [*gridtrain_command(), *argv, "--config", "config.py", "job.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the test can clean up whatever a failed fix leaves behind
    )


def processes_in(directory: Path) -> list[int]:
    """Pids of living processes (not zombies, not this one) working in ``directory``: the job's
    launcher, agent(s) and workers all run there."""
    found = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd == str(directory) and state != b"Z" and pid != os.getpid():
            found.append(pid)
    return found


def gone_within(directory: Path, seconds: float) -> list[int]:
    """``processes_in(directory)`` once it is empty, or as it is ``seconds`` from now (no
    process starts there once the launcher has exited: an empty list stays empty)."""
    deadline = time.monotonic() + seconds
    while (left := processes_in(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def job_dir(tmp_path):
    """tmp_path; every process still working there at the end is killed (by its own pid)."""
    yield tmp_path
    for pid in processes_in(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for_line(proc: subprocess.Popen, lines: list[str], needles: set[str], timeout=240):
    """Read output lines until every needle has appeared in one (collected into ``lines``)."""
    deadline = time.monotonic() + timeout
    missing = set(needles)
    while missing and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        missing = {n for n in missing if n not in line}
    assert not missing, f"never printed {missing}:\n{''.join(lines)}"


# ---- the rendezvous store ------------------------------------------------------------------
LISTENERS = """
import fcntl, socket, struct

def listening(port):
    # local addresses of listening TCP sockets on `port`, from /proc/net/tcp and tcp6
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found

def other_addresses():
    # this machine's IPv4 addresses but loopback's (SIOCGIFADDR on every interface)
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _, name in socket.if_nameindex():
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            continue  # no IPv4 address
        addr = socket.inet_ntoa(packed[20:24])
        if not addr.startswith("127."):
            found.append(addr)
    return found

def reach(addr, port):
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return "connected"
    except OSError as err:
        return type(err).__name__

ctx = gt.launch_from_torch(backend="gloo")
if ctx.global_rank == 0:
    port = int(os.environ["MASTER_PORT"])
    say(f"store listens on {sorted(listening(port))}")
    say(f"store from 127.0.0.1: {reach('127.0.0.1', port)}")
    for addr in other_addresses():
        say(f"store from {addr}: {reach(addr, port)}")
dist.barrier()
gt.destroy()
"""


def test_local_run_store_listens_on_loopback_only(job_dir):
    """Issue 33 item 8, the README's threat model: on one machine the store (no authentication)
    is reachable from this machine only. The launcher chooses the port, as for a user."""
    code, out = finish(start(job_dir, LISTENERS, port=False))
    assert code == 0, out
    # 0100007F is 127.0.0.1 as /proc writes it; all interfaces would be 00000000 (or :: in tcp6)
    assert "rank 0 store listens on ['0100007F']" in out, out
    assert "rank 0 store from 127.0.0.1: connected" in out, "control: the store is there"
    others = [line for line in out.splitlines() if line.startswith("rank 0 store from ")][1:]
    for line in others:  # through this machine's other interfaces: nobody listens
        assert line.endswith(": ConnectionRefusedError"), out


# ---- signals --------------------------------------------------------------------------------
FOREVER = """
ctx = gt.launch_from_torch(backend="gloo")
say(f"pid {os.getpid()} training")
while True:  # a job that would train forever
    dist.all_reduce(torch.ones(4))
    time.sleep(0.05)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_gridtrain_run_stops_every_worker(job_dir, signum):
    proc = start(job_dir, FOREVER)
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid"})
    workers = [int(line.split()[3]) for line in lines if " pid " in line and "training" in line]
    assert len(workers) == 2
    os.kill(proc.pid, signum)  # gridtrain run alone, as `kill PID` or a scheduler would
    code, out = finish(proc, timeout=120)
    assert code == 128 + signum, "".join(lines) + out
    left = gone_within(job_dir, 1.0)  # the agent reaps its workers as it exits
    assert left == [], f"still running after gridtrain run exited: {left}\n{''.join(lines)}{out}"
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or b"Z" in Path(f"/proc/{pid}/stat").read_bytes()


def test_sigkill_to_the_launchers_group_leaves_no_process_behind(job_dir):
    """Issue 28 item 8: the agent and the workers live in sessions of their own, so killing
    `gridtrain run`'s process group (a scheduler's hard stop) must still end them."""
    proc = start(job_dir, FOREVER)
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid"})
    assert len(processes_in(job_dir)) >= 4, "launcher, agent and two workers"
    os.killpg(proc.pid, signal.SIGKILL)  # start() made gridtrain run a group leader
    proc.wait()
    deadline = time.monotonic() + 10
    while processes_in(job_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_in(job_dir)
    assert left == [], f"survived the launcher: {[_cmdline(pid) for pid in left]}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid} (gone)"


FAKE_SSH = """#!/bin/sh
# fake ssh: [OPTIONS] -- HOST COMMAND; runs COMMAND here, as sshd would on HOST
while [ "$1" != "--" ]; do shift; done
exec sh -c "$3"
"""


def test_sigterm_reaches_the_workers_of_every_host(job_dir, monkeypatch):
    """The multi-host path: one (fake, local) ssh session per host, SIGTERM to gridtrain run."""
    ssh = job_dir / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}{os.pathsep}{os.environ['PATH']}")
    proc = start(job_dir, FOREVER, "", "--host", "node1,node2", "--master_addr", "127.0.0.1")
    lines: list[str] = []
    # one process per node here (--nproc_per_node 2 x 2 hosts = 4 ranks)
    wait_for_line(proc, lines, {"rank 0 pid", "rank 1 pid", "rank 2 pid", "rank 3 pid"})
    assert any(line.startswith("[node2] ") for line in lines), "".join(lines)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM, "".join(lines) + out
    left = gone_within(job_dir, 1.0)  # the agent reaps its workers as it exits
    assert left == [], f"still running after gridtrain run exited: {left}\n{''.join(lines)}{out}"


# ---- failures -------------------------------------------------------------------------------
STUCK_TIMEOUT_S = 5
STUCK = """
ctx = gt.launch_from_torch(backend="gloo")
say("launched")

def stuck_here():
    time.sleep(3600)  # a rank that hangs (a deadlock, a dead file system...)

if ctx.global_rank == 1:
    stuck_here()
dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 here
"""


def test_a_stuck_rank_ends_the_job_within_timeout_s_showing_where_it_hung(job_dir):
    """Issue 28 item 9: the report names the rank that never arrived, with its stack; rank 0,
    which was only waiting, is not the root cause."""
    # 5 s, as test_a_frozen_rank_is_reported_as_stopped_not_killed: the timeout is waited out
    proc = start(job_dir, STUCK, f"timeout_s = {STUCK_TIMEOUT_S}\n")
    lines: list[str] = []
    wait_for_line(proc, lines, {"rank 0 launched", "rank 1 launched"})
    launched = time.monotonic()
    code, out = finish(proc, timeout=180)
    elapsed = time.monotonic() - launched
    text = "".join(lines) + out
    assert code != 0, text
    # the timeout, then the agent stops rank 1 and exits; slack for a loaded machine
    assert elapsed < STUCK_TIMEOUT_S + 40, (elapsed, text)
    report = out[out.index("rank 1 did not arrive") :]
    assert "rank 0 timed out waiting for it" in report, text
    # rank 1's stack, dumped when the agent stopped it: the line it was stuck on
    assert "in stuck_here" in report and "job.py" in report, text
    assert "Root Cause" not in text and "rank 0 failed" not in text, text


RAISES = """
ctx = gt.launch_from_torch(backend="gloo")
if ctx.global_rank == 1:
    time.sleep(1)
    raise ValueError("boom from rank 1")
dist.all_reduce(torch.ones(1))  # rank 0 learns of it as a lost connection
"""


def test_the_failing_rank_traceback_comes_once_and_the_others_get_one_line(job_dir):
    """Issue 27, one error once: the failing rank's message, then its traceback, once; rank 0's
    lost connection is one line, not a second traceback."""
    code, out = finish(start(job_dir, RAISES))
    assert code == 1, out
    assert out.count("ValueError: boom from rank 1") == 1 and out.count("Traceback") == 1, out
    report = out[out.index("rank 1 failed: ValueError: boom from rank 1") :]
    assert 'raise ValueError("boom from rank 1")' in report, "the traceback follows"
    assert "rank 0: stopped after rank 1 failed" in report, out
    assert "by peer" not in out and "Root Cause" not in out and "SIGTERM" not in out, out


# ---- restarts -------------------------------------------------------------------------------
RESTARTS = """
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ctx = gt.launch_from_torch(backend="gloo")
say(f"attempt {attempt}")
marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "failed_once")
if ctx.global_rank == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    raise SystemExit(3)  # one rank dies on the first attempt only
t = torch.ones(1)
dist.all_reduce(t)
say(f"finished attempt {attempt} sum {t.item():.0f}")
gt.destroy()
"""


def test_max_restarts_restarts_every_rank_and_the_job_succeeds(job_dir):
    code, out = finish(start(job_dir, RESTARTS, "", "--max-restarts", "1"))
    assert code == 0, out
    for rank in (0, 1):
        assert f"rank {rank} attempt 0" in out and f"rank {rank} attempt 1" in out, out
        assert f"rank {rank} finished attempt 1 sum 2" in out, out
    assert "finished attempt 0" not in out, "rank 1 died before the first all-reduce"
    # rank 0 lost its peer: a planned restart, not an error to show
    assert "Traceback" not in out and "by peer" not in out, out


# ---- forked workers -------------------------------------------------------------------------
FINGERPRINT = """
import multiprocessing
ctx = gt.launch_from_torch(backend="gloo")
seen = dict(
    argv=sys.argv, file=__file__, name=__name__, path0=sys.path[0], cwd=os.getcwd(),
    threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"),
    process=multiprocessing.current_process().name, parent=multiprocessing.parent_process(),
    session_leader=os.getsid(0) == os.getpid(), stdin_isatty=sys.stdin.isatty(),
    unbuffered=sys.stdout.write_through, local_rank=os.environ["LOCAL_RANK"],
)
say(f"seen {sorted(seen.items())}")
gt.destroy()
raise SystemExit(4 if ctx.global_rank == 0 else 0)
"""


def test_a_forked_worker_sees_what_a_fresh_interpreter_sees(job_dir):
    """README "gridtrain run": workers fork from a copy of the agent that imported torch once
    (GRIDTRAIN_PREFORK=0: fresh interpreters, as torchrun starts them). The script must not
    tell them apart: argv, __file__, sys.path[0], torch's thread count, its own session, the
    exit code it chose."""
    outs = {}
    # both jobs at once (the same files, their own ports): the fresh one's imports and the
    # launchers' start-up overlap on the cores instead of following each other
    procs = {prefork: start(job_dir, FINGERPRINT, prefork=prefork) for prefork in ("1", "0")}
    for prefork, proc in procs.items():
        code, out = finish(proc)
        assert code == 1, out  # rank 0's own exit code 4: the job failed
        outs[prefork] = sorted(line for line in out.splitlines() if not line.startswith("W"))
        assert sum(" seen " in line for line in outs[prefork]) == 2, out
    assert outs["1"] == outs["0"], f"forked:\n{outs['1']}\nfresh:\n{outs['0']}"
    assert "('omp', '1')" in outs["1"][0] and "('threads', 1)" in outs["1"][0], outs["1"]
