"""The processes `gridtrain run` starts: each in its own session, signals forwarded, none left over.

``gridtrain run`` starts torch's elastic agent (or one ssh per host) in a new
session, so that a signal sent to ``gridtrain run`` alone cannot leave the agent
and its workers running (re-parented) after it exits. SIGTERM, SIGINT
and SIGHUP are forwarded to each child's process group; the agent then stops
its workers the way it does on a failure (SIGTERM, and SIGKILL after its own
grace). Whatever is still alive ``grace_s`` later, or once the agent has gone,
is killed: the agent's workers each live in a session of their own, so the
supervisor remembers every descendant it has seen (Linux ``/proc``) and kills
those that remain.

No handler runs when ``gridtrain run`` itself is killed (SIGKILL to its process
group, say), so every child is started through ``die_with_parent``: on Linux the
kernel sends it SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); the agent
starts its workers the same way, so the whole tree goes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
Proc = tuple[int, int]  # (pid, start time): a pid alone may be reused

# Run before the real command, in the child: ask the kernel for SIGKILL when the parent dies
# (prctl PR_SET_PDEATHSIG = 1), quit if it already has, then become the command. A tiny
# interpreter of its own (-I: no site, no gridtrain import), because Popen's preexec_fn is
# unsafe in a process with threads; the setting survives exec.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: Sequence[str], parent: int | None = None) -> list[str]:
    """``argv`` run so that the kernel kills it when ``parent`` (default: this process) dies;
    the thread that starts it must live as long as that process (the main thread: Linux ties
    the signal to the parent thread). ``argv`` unchanged where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    parent = os.getpid() if parent is None else parent
    return [sys.executable, "-I", "-c", _DIE_WITH_PARENT, str(parent), *argv]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid`` from /proc; None if it is gone, a zombie, or there is
    no /proc (then nothing is tracked and only the children's process groups are signalled)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])  # ppid, starttime (fields 4 and 22 of stat)


def descendants(roots: Sequence[int]) -> set[Proc]:
    """Every living process below ``roots`` (not the roots themselves), by walking /proc."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return set()
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
            starts[pid] = stat[1]
    found: set[Proc] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if (child, starts[child]) not in found:
                found.add((child, starts[child]))
                todo.append(child)
    return found


def _alive(proc: Proc) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[1] == proc[1]


class Supervisor:
    """Start children in their own sessions; forward signals; leave nothing running on exit.

    Use as a context manager around ``start`` and ``wait``::

        with Supervisor() as sup:
            proc = sup.start(argv, env=env)
            code = sup.wait(proc)
        # sup.signalled: the first signal received (then the exit code is 128 + it)
    """

    def __init__(self, grace_s: float = 45.0, poll_s: float = 0.2):
        self.grace_s = grace_s  # after a forwarded signal, how long the children get to stop
        self.poll_s = poll_s
        self.procs: list[subprocess.Popen] = []
        self.seen: set[Proc] = set()  # every descendant seen so far
        self.signalled: int | None = None
        self._deadline: float | None = None
        self._saved: dict[int, object] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Supervisor:
        for sig in FORWARDED:
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)

    def start(self, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """``Popen(argv, **popen_kwargs)`` in a new session (so in a process group of its own),
        killed by the kernel if this process dies first (``die_with_parent``)."""
        argv = die_with_parent(argv)
        proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
        self.procs.append(proc)
        return proc

    # ---- signals -------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        if self.signalled is None:
            self.signalled = signum
            self._deadline = time.monotonic() + self.grace_s
            self.send(signum)
        else:  # a second signal: stop waiting
            self.kill()

    def send(self, signum: int) -> None:
        """Send ``signum`` to each running child's process group."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signum)

    # ---- waiting -------------------------------------------------------------------------
    def track(self) -> None:
        """Remember the children's current descendants (they may outlive a dead parent)."""
        self.seen |= descendants([p.pid for p in self.procs if p.poll() is None])

    def poll(self) -> None:
        """One supervision step: track descendants; after a signal's grace, kill everything."""
        self.track()
        if self._deadline is not None and time.monotonic() > self._deadline:
            self.kill()

    def wait(self, proc: subprocess.Popen) -> int:
        """Wait for ``proc`` while supervising; returns its return code."""
        while True:
            try:
                return proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                self.poll()

    def wait_all(self) -> Iterator[None]:
        """Yield once per poll interval while any child runs (for callers that watch several)."""
        while any(p.poll() is None for p in self.procs):
            self.poll()
            yield
            time.sleep(self.poll_s)

    # ---- stopping ------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL every child's process group and every descendant seen."""
        self.track()
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self._kill_seen(signal.SIGKILL)

    def _kill_seen(self, signum: int) -> None:
        for proc in self.seen:
            if _alive(proc):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc[0], signum)

    def stop(self, grace_s: float = 5.0) -> None:
        """End whatever is left: children get SIGTERM, then SIGKILL after ``grace_s``; so do
        descendants left behind by a child that has already exited."""
        self.track()
        running = [p for p in self.procs if p.poll() is None]
        left = [p for p in self.seen if _alive(p)]
        if running or left:
            self.send(signal.SIGTERM)
            self._kill_seen(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (
                any(p.poll() is None for p in running) or any(_alive(p) for p in left)
            ):
                time.sleep(0.05)
            self.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)


def exit_code(returncode: int) -> int:
    """A child killed by signal N reports -N; shells report 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_local(argv: list[str], config: str | None) -> int:
    """Run the launcher on this machine with GRIDTRAIN_CONFIG set (unset for None: the
    workers run with the defaults); return its exit code.

    A signal sent to ``gridtrain run`` (SIGTERM, SIGINT, SIGHUP) reaches the
    launcher, which stops its workers; the exit code is then 128 + the signal.
    """
    from gridtrain.config import CONFIG_ENV

    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    if config is not None:
        env[CONFIG_ENV] = config
    with Supervisor() as sup:
        code = sup.wait(sup.start(argv, env=env))
    return 128 + sup.signalled if sup.signalled is not None else exit_code(code)


def run_hosts(commands: list[tuple[str, list[str]]], poll_s: float = 0.1) -> int:
    """Run one ssh session per host, each output line prefixed with ``[host]``.

    Returns 0 when every host succeeds, else the exit code of the first host to
    fail; the other sessions are then ended, since their workers cannot finish
    without the failed node. Ending an ``ssh -tt`` session hangs up its remote
    terminal, and the remote launcher stops its workers; so does a signal sent
    to ``gridtrain run``, which is forwarded to every session (exit code 128 + it).
    """
    lock = threading.Lock()
    out = sys.stdout.buffer

    def pump(host: str, stream) -> None:
        prefix = f"[{host}] ".encode()
        for line in iter(stream.readline, b""):
            with lock:
                out.write(prefix + line.rstrip(b"\r\n") + b"\n")  # a remote tty ends lines \r\n
                out.flush()

    procs, threads = [], []
    failed: tuple[str, int] | None = None
    with Supervisor(poll_s=poll_s) as sup:
        for host, argv in commands:
            proc = sup.start(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            thread = threading.Thread(target=pump, args=(host, proc.stdout), daemon=True)
            thread.start()
            procs.append((host, proc))
            threads.append(thread)
        for _ in sup.wait_all():
            failed = next(((h, p.returncode) for h, p in procs if p.poll()), None)
            if failed is not None and sup.signalled is None:
                break
        if failed is None:  # all exited; one may have failed during the last sleep
            failed = next(((h, p.returncode) for h, p in procs if p.returncode), None)
    for thread in threads:
        thread.join(timeout=5)
    if sup.signalled is not None:
        return 128 + sup.signalled
    if failed is None:
        return 0
    host, code = failed
    print(f"gridtrain run: host {host} exited with code {exit_code(code)}", file=sys.stderr)
    return exit_code(code)
