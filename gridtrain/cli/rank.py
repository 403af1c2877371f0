"""A worker forked from the agent's server (``cli/prefork``) becomes ``python -u SCRIPT ARGS``.

The server is a copy of the agent made before it ran anything; each fork inherits its imports
and little else that ``python -u train.py`` would not have. ``Launch._bootstrap`` (called by
``multiprocessing``'s forkserver in the new process, ``spawn._main``) then sets up what torch's
agent gives a worker it starts with ``Popen``:

- a session of its own (``start_new_session=True``), and the kernel's SIGKILL when the server
  dies (the server dies with the agent: ``cli/prefork``);
- the agent's stdin, stdout and stderr (passed as file descriptors, or torch's redirect files),
  written through unbuffered as with ``-u``;
- the environment torch built for the worker (the agent's plus ``RANK``, ``LOCAL_RANK``, ...),
  the agent's working directory;
- ``sys.argv`` as typed, ``sys.path[0]`` the script's directory (the current one for ``-m``);
  the script runs in the real ``__main__`` module, ``__file__`` absolute, as ``python`` runs it;
- the interpreter's exit: an uncaught exception goes to ``sys.excepthook`` (exit code 1;
  KeyboardInterrupt ends by SIGINT), ``SystemExit`` gives its code, then non-daemon threads are
  joined, ``atexit`` handlers run, the script's objects are collected (files it left open are
  flushed) and stdout and stderr flushed.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker

from gridtrain.children import set_parent_death_signal


@dataclass
class Launch:
    """One worker's command as torch's agent built it, for the forked process to become."""

    argv: list[str]  # what follows the interpreter: ["-u", ("-m",) target, *args]
    env: dict[str, str]
    cwd: str
    stdout: str | None = None  # torch's redirect files (--redirects / --tee); None: the agent's
    stderr: str | None = None

    def _bootstrap(self, parent_sentinel: int) -> int:
        """Entry point in the forked process (``multiprocessing.spawn._main``); returns the exit
        code, which the forkserver passes to ``os._exit``."""
        os.close(parent_sentinel)
        os.setsid()
        set_parent_death_signal(os.getppid())
        _forget_the_server()
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        threads_from_env(os.environ)
        _stdio(self.stdout, self.stderr)
        return _run(self.argv)


def _forget_the_server() -> None:
    """Close what the forkserver handed this process for its own use (its liveness pipe, the
    agent's resource tracker), so that the server ends with the agent and this process starts
    its own multiprocessing helpers when it needs them, as a fresh interpreter would."""
    fds = [forkserver._forkserver._forkserver_alive_fd, resource_tracker._resource_tracker._fd]
    for fd in fds:
        if fd is not None:
            os.close(fd)
    forkserver._forkserver._forkserver_alive_fd = None
    forkserver._forkserver._forkserver_address = None
    resource_tracker._resource_tracker._fd = None


def threads_from_env(env) -> None:
    """torch read ``OMP_NUM_THREADS`` when the process this one was forked from imported it
    (the agent, before torchrun set it for the workers: 1 for several per node, unless
    given): apply ``env``'s value as an import would have."""
    value = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _stdio(stdout: str | None, stderr: str | None) -> None:
    """fds 0-2 from the agent (passed with the request), or the redirect files; new
    ``sys.std*`` objects over them, written through as under ``python -u``."""
    inherited = forkserver.get_inherited_fds()
    for fd, source in zip((0, 1, 2), inherited, strict=True):
        os.dup2(source, fd)
        os.close(source)
    forkserver._forkserver._inherited_fds = None
    for fd, path in ((1, stdout), (2, stderr)):
        if path is not None:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
    # the server's own objects give the encodings (the same environment chose them)
    like = sys.__stdin__, sys.__stdout__, sys.__stderr__
    sys.stdin = sys.__stdin__ = _text(open(0, "rb", closefd=False), like[0], False)
    sys.stdout = sys.__stdout__ = _text(open(1, "wb", buffering=0, closefd=False), like[1], True)
    sys.stderr = sys.__stderr__ = _text(open(2, "wb", buffering=0, closefd=False), like[2], True)


def _text(raw, like, write_through: bool) -> io.TextIOWrapper:
    return io.TextIOWrapper(
        raw,
        encoding=getattr(like, "encoding", None),
        errors=getattr(like, "errors", None),
        write_through=write_through,
    )


def _run(argv: list[str]) -> int:
    """Run ``python ARGV``'s program (``-u`` already applied); the exit code as the interpreter
    would give it."""
    args = argv[1:] if argv[:1] == ["-u"] else list(argv)
    interrupted = False
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            _run_script(args[0])
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as err:  # noqa: BLE001 - reported as the interpreter reports it
        interrupted = isinstance(err, KeyboardInterrupt)
        sys.excepthook(type(err), err, err.__traceback__)
        del err
        code = 1
    _finalize()
    if interrupted:  # CPython ends an uncaught Ctrl-C by SIGINT, so the parent sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run_script(path: str) -> None:
    """What ``python path`` does: ``sys.path[0]`` the script's (resolved) directory, the code
    run in the real ``__main__`` module with an absolute ``__file__`` (``runpy.run_path`` runs
    it in a temporary module and sets ``sys.argv[0]`` to its argument)."""
    full = os.path.abspath(path)
    sys.path[0] = os.path.dirname(os.path.realpath(full))
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", full),
        __file__=full,
        __cached__=None,
        __builtins__=builtins,
    )
    with io.open_code(full) as f:
        code = compile(f.read(), full, "exec")
    exec(code, main.__dict__)  # noqa: S102 - running the user's script is the point


def _exit_code(code: object) -> int:
    """``SystemExit(code)``'s exit status: None is 0, an int itself, anything else is printed
    to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finalize() -> None:
    """The parts of the interpreter's shutdown a script can observe: non-daemon threads
    joined, ``atexit`` handlers, the script's objects collected, stdio flushed."""
    threading._shutdown()  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    sys.modules["__main__"].__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
