"""Run a Python script or ``gridtrain`` command as a fresh process without paying for imports.

A test that runs ``python benchmarks/x.py ...`` as a subprocess spends 3-4 CPU seconds
importing torch before the script does anything; on a 2-core machine, over a few dozen
such runs, that is minutes. Here every run is forked from one server process that has
imported torch and gridtrain once (``multiprocessing``'s forkserver with a preload): the
child is a real, separate process (its own globals, its own process groups, its exit
code), started with the script's ``sys.argv`` and working directory, its stdout and
stderr captured to files.

The server imports but never runs torch code, so no thread pool exists to be broken by
the fork; CUDA is never initialised in it (``CUDA_VISIBLE_DEVICES`` set for a run still
takes effect in the child).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import runpy
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from gridtrain.cli.rank import threads_from_env

_CTX = None
# what the server imports once; every process forked from it (these runs, and the pool of
# helpers.harness) starts with them loaded. Not transformers' model code (3-5 s of CPU): with
# it the server started 6 s later and every forked `gridtrain run` took 1.5-4 s longer
# (measured alternating on the loaded 2-core machine), more than the few forked Hugging Face
# processes gain; pool workers import it once each.
PRELOAD = ["torch", "torch.distributed", "gridtrain", "gridtrain.engine", "gridtrain.cli.main"]


@dataclass
class Result:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would give."""

    returncode: int
    stdout: str
    stderr: str


def context():
    """The multiprocessing context whose processes fork from the preloaded server."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    gc.freeze()  # the preloaded heap, as gridtrain run's forked ranks (cli/prefork)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    threads_from_env(env)  # as a rank forked by gridtrain run does
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 0
    try:
        if argv[0] == "gridtrain":
            sys.argv = ["gridtrain", *argv[1:]]
            runpy.run_module("gridtrain.cli", run_name="__main__", alter_sys=True)
        else:
            script = str(Path(argv[0]).resolve())
            sys.argv = [script, *argv[1:]]
            sys.path.insert(0, str(Path(script).parent))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported like an interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 240):
    """Run ``argv`` (``[script.py, *args]`` or ``["gridtrain", *args]``) in a forked process.

    Returns a ``Result``; a run past ``timeout`` seconds is killed and raises TimeoutError.
    """
    ctx = context()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.touch()
        err.touch()
        proc = ctx.Process(
            target=_child, args=(argv, str(cwd), dict(env or os.environ), str(out), str(err))
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"{' '.join(argv)} ran past {timeout} s:\n{err.read_text()[-3000:]}")
        return Result(proc.exitcode, out.read_text(), err.read_text())
