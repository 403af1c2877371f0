"""Workers forked from a copy of the agent that has torch and gridtrain imported, instead of
each starting a fresh interpreter.

torch's agent starts every worker as ``python -u train.py ARGS``: each imports torch again (3-4 s
of CPU on a small machine, all of a node's ranks at once, and again after every
``--max-restarts`` restart), although the agent has just imported it. Here the agent, once it
has imported torch and before it starts any thread, forks a
server that runs ``multiprocessing``'s forkserver loop; each worker is forked from that server
and becomes ``python -u train.py ARGS`` there (``cli/rank``). Only the start changes: torch's
``SubprocessContext`` still polls, reports, restarts and stops the workers, through a handler
whose ``proc`` has the part of ``Popen``'s interface it uses (``pid``, ``poll``, ``wait``,
``returncode``); the worker leads a process group of its own, as ``Popen(start_new_session=True)``
makes it.

The server takes a session of its own (a signal ``gridtrain run`` forwards to the agent's group
must reach the agent alone, which stops the workers in order) and dies with the agent
(``PR_SET_PDEATHSIG``); each worker dies with the server.

A worker starts as a fresh interpreter, through ``procs.die_with_parent``, when forking could
change what it sees: ``GRIDTRAIN_PREFORK=0``; a command that is not ``python -u`` of this
interpreter (``--no-python``, ``PYTHON_EXEC``, numa binding); ``--nproc_per_node`` not a number
(torchrun then asks CUDA for the device count, and a process forked after that cannot use CUDA);
a machine with CUDA (forked workers could not use it on torch 2.11); a second Python thread
running in the agent at the fork; the agent's environment
changed since the fork (torch reads some variables, ``OMP_NUM_THREADS`` among them, at import).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing import connection, forkserver, reduction, util
from multiprocessing.connection import wait as wait_ready

from gridtrain.children import set_parent_death_signal
from gridtrain.cli.rank import Launch

logger = logging.getLogger(__name__)

PREFORK_ENV = "GRIDTRAIN_PREFORK"  # "0": every worker a fresh interpreter, as torchrun starts it
# what a worker inherits imported: what the agent imports itself. More (gridtrain.engine,
# adapters: 1.8 s) would delay every worker by its import, where the workers that need it
# import it side by side (measured: a 2-rank job on an idle 2-core machine took longer).
PRELOAD = ["torch.distributed", "gridtrain.launch"]
_ENV_AT_FORK: dict[str, str] = {}
AGENT_VARIABLES = "TORCHELASTIC_"


def start_server(nproc_per_node) -> bool:
    """Fork the server the workers will fork from, where nothing in the module docstring's list
    forbids it; returns whether it did."""
    import torch

    if sys.platform != "linux" or os.environ.get(PREFORK_ENV, "1") == "0":
        return False
    if not str(nproc_per_node).isdigit() or torch.cuda.is_initialized():
        return False
    # A CUDA machine: on an H100 with torch 2.11 every forked worker failed its first CUDA
    # call ("Cannot re-initialize CUDA in forked subprocess": a device query in the launcher
    # had already made fork unsafe). Workers there start as fresh interpreters; the query
    # here is harmless, as nothing forks after it.
    if torch.cuda.is_available():
        logger.debug("gridtrain run: a CUDA machine; workers start as fresh interpreters")
        return False
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # native idle pools (OpenBLAS's) handle fork themselves
        logger.debug("gridtrain run: the agent runs threads; workers start as fresh interpreters")
        return False
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # EOF for the server when the agent has gone
        agent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, agent)
        os.close(alive_r)
    server = forkserver._forkserver  # connect_to_new_process talks to the server held here
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    _ENV_AT_FORK.update(os.environ)
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, agent: int) -> None:
    """The server: a session of its own, dying with the agent, then the forkserver's loop
    (until the agent and every worker have closed the liveness pipe). Never returns."""
    code = 1
    try:
        os.close(alive_w)
        os.setsid()
        set_parent_death_signal(agent)
        # the imported heap leaves the collector's view (Python's advice before fork): a
        # worker's collections, gridtrain.destroy's among them, skip it (0.2 s each on a
        # small machine) and leave its pages shared
        gc.freeze()
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        code = 0
    finally:
        os._exit(code)


class ForkedProcess:
    """A worker forked from the server: ``pid``, ``poll()``, ``wait(timeout)`` and ``returncode``
    as ``subprocess.Popen`` has them."""

    def __init__(self, launch: Launch):
        # the agent's stdin, stdout and stderr travel with the request (SCM_RIGHTS)
        with _stdio_fds() as fds:
            self._sentinel, request = forkserver.connect_to_new_process(fds)
        with open(request, "wb", closefd=True) as f:
            reduction.dump({}, f)  # spawn._main's preparation data: nothing to prepare
            reduction.dump(launch, f)  # its _bootstrap runs in the new process
        self.pid = forkserver.read_signed(self._sentinel)
        self.returncode: int | None = None
        self.args = launch.argv

    def poll(self) -> int | None:
        if self.returncode is None and wait_ready([self._sentinel], 0):
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not wait_ready([self._sentinel], timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        """The server writes the exit status (``waitstatus_to_exitcode``: -N for signal N)."""
        try:
            self.returncode = forkserver.read_signed(self._sentinel)
        except (OSError, EOFError):
            self.returncode = 255  # the server went away first (multiprocessing's choice too)
        os.close(self._sentinel)


@contextlib.contextmanager
def _stdio_fds():
    """fds 0, 1 and 2 of this process; /dev/null for one that is closed (Popen's child would
    find it closed too, but a closed fd cannot be sent)."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


class ForkedHandler:
    """torch's ``SubprocessHandler`` for a forked worker (``proc``, ``local_rank_id``,
    ``close``)."""

    def __init__(self, launch: Launch, local_rank_id: int):
        self.local_rank_id = local_rank_id
        self.proc = ForkedProcess(launch)

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """``death_sig`` (default SIGTERM) to the worker's process group, as torch's handler;
        to the worker alone in the moment before it has made its group."""
        sig = death_sig or signal.SIGTERM
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)


def _launch(entrypoint: str, args: tuple, env: dict, stdout, stderr, numa) -> Launch | None:
    """The ``Launch`` for torch's worker command, or None where it is not ``python -u`` of this
    interpreter or the environment has changed since the fork."""
    argv = [str(a) for a in args]
    if entrypoint != sys.executable or argv[:1] != ["-u"] or numa is not None or len(argv) < 2:
        return None
    if (argv[1] == "-m" and len(argv) < 3) or _env_changed():
        return None
    return Launch(argv, {**os.environ, **env}, os.getcwd(), stdout or None, stderr or None)


def _env_changed() -> bool:
    """Whether the agent's environment differs from the one the server was forked with, but for
    torch's agent's own ``TORCHELASTIC_*`` (``TORCHELASTIC_SIGNALS_TO_HANDLE``, set as it starts,
    is read by torch's elastic code when it runs, not at import)."""
    now = {k: v for k, v in os.environ.items() if not k.startswith(AGENT_VARIABLES)}
    then = {k: v for k, v in _ENV_AT_FORK.items() if not k.startswith(AGENT_VARIABLES)}
    return now != then


def handler_factory(get_subprocess_handler, wrap_command, forked: bool):
    """torch's ``get_subprocess_handler``, with workers forked from the server where ``forked``
    and ``_launch`` allow; other commands go through ``wrap_command``
    (``procs.die_with_parent``) to torch's own."""

    def get_handler(
        entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None, **kwargs
    ):
        launch = _launch(entrypoint, args, env, stdout, stderr, numa_options) if forked else None
        if launch is not None and not kwargs:
            return ForkedHandler(launch, local_rank_id)
        entrypoint, *args = wrap_command([entrypoint, *map(str, args)])
        return get_subprocess_handler(
            entrypoint=entrypoint,
            args=tuple(args),
            env=env,
            stdout=stdout,
            stderr=stderr,
            local_rank_id=local_rank_id,
            numa_options=numa_options,
            **kwargs,
        )

    return get_handler
