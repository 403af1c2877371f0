"""Run a function on N gloo processes on the CPU, with pooled workers.

``run_distributed(fn, world_size, config=...)`` launches gridtrain on ranks
0..N-1 (a fresh port each call), calls ``fn(ctx, *args)`` on each and returns
the per-rank results in rank order. ``backend="staged"`` launches them as CUDA
ranks sharing the GPU instead (tests/gpu), collectives through gloo on host copies. A rank that raises fails the call with that
rank's traceback; ranks left waiting in a collective are killed after a short
grace instead of hanging, and so is a call that exceeds its timeout.

Workers start once and are reused by later calls; each is forked from a server that
imported torch and gridtrain once (``helpers.forked``), so starting one, growing the pool
or replacing a discarded one costs no import. The pool starts as many workers as the
machine has cores and grows only when a call needs more ranks, so a 2-core machine runs
most tests on 2 processes; a call in which a rank raised keeps the pool when every rank
reported (the failure is the test's point, nothing is left waiting), and only a call with
a rank that never reported (stuck in a collective, timed out, crashed) discards it.

A rank's result leaves it as owned CPU copies: every tensor is copied to the host
before the rank tears down (a CUDA tensor would cross as an IPC handle on memory the rank
frees), and a DTensor (an FSDP2 / ZeRO 3 shard) is refused with its place in the
result. The queue otherwise moves a tensor's own storage into shared memory from a
background thread after the function returned, which crashes the worker on storage
FSDP2 still manages, and the call then waits out its whole timeout.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from helpers import forked

MAX_WORKERS = 8  # the largest world a test may ask for
GRACE_S = 5.0  # after one rank fails, how long the others get to report
POLL_S = 1.0  # how often a call's wait looks for workers that died


# Under pytest-xdist each test process draws ports from its own block below the kernel's
# ephemeral range (where a bind to port 0, gloo's pair sockets included, gets its port), so
# two processes never pick the same free port between the check and rank 0's bind.
PORT_BLOCK = (20000, 1000)  # first port of worker gw0, ports per worker
_port_counter = itertools.count(os.getpid())  # pid-dependent: another run's gwN starts elsewhere


def free_port() -> int:
    """A port that is free now and that no other test process of this run will pick."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first, size = PORT_BLOCK
    first += int(worker[2:]) * size
    for _ in range(size):
        port = first + next(_port_counter) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # held, or still in TIME_WAIT
            return port
    raise RuntimeError(f"no free port in {first}..{first + size - 1}")


def owned(value: Any, where: str = "result") -> Any:
    """``value`` with every tensor in it (nested in tuples, lists, dicts and dataclasses)
    replaced by a detached copy on the CPU; a DTensor is a ``TypeError`` naming where it is."""
    import dataclasses

    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        raise TypeError(
            f"{where} is a DTensor (this rank's shard of an FSDP2 / ZeRO 3 tensor): gather it "
            "on every rank first (gt.full_state_dict, gt.full_optimizer_state_dict)"
        )
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)({k: owned(v, f"{where}[{k!r}]") for k, v in value.items()})
    if isinstance(value, list | tuple):
        items = [owned(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: owned(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **fields)
    return value


def _worker(index: int, tasks: mp.Queue, results: mp.Queue) -> None:
    import faulthandler
    import gc

    import torch

    faulthandler.enable(all_threads=True)  # a crash in native code shows every thread's stack
    torch.set_num_threads(1)
    while True:
        # what survives the last call (torch, gridtrain, a library a test imported) leaves
        # the collector's view: a full collection (gridtrain.destroy runs one) then scans
        # only what the next call makes, not the 0.2 s of imported heap per rank
        gc.collect()
        gc.freeze()
        task = tasks.get()
        if task is None:
            return
        call_id, fn, rank, world_size, port, config, args, kwargs, do_launch, backend = task
        try:
            if do_launch:
                import gridtrain as gt

                ctx = gt.launch(config or {}, rank, world_size, "127.0.0.1", port, backend=backend)
                try:
                    out = owned(fn(ctx, *args, **kwargs))
                finally:
                    gt.destroy()
            else:
                out = owned(fn(rank, world_size, port, *args, **kwargs))
            results.put((call_id, rank, True, out))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            results.put((call_id, rank, False, traceback.format_exc()))
        finally:
            _leave_no_group()


def _leave_no_group() -> None:
    """After a call, no process group survives (a launch that failed half-way, a ``fn`` of
    ``launch=False`` that raised), so the next call in this worker starts clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            import gridtrain as gt

            gt.destroy()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def initial_size() -> int:
    """Workers to start with: the machine's cores shared among pytest-xdist's test
    processes, at least 2 and at most ``MAX_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    streams = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(2, min(MAX_WORKERS, (cores or 2) // streams))


class _Pool:
    def __init__(self, size: int):
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the server starts
        self._mp = forked.context()
        self.results: mp.Queue = self._mp.Queue()
        self.tasks: list[mp.Queue] = []
        self.procs: list = []
        self.calls = 0
        self.grow(size)

    def grow(self, size: int) -> None:
        """Start workers until there are ``size`` (all start together: their imports overlap)."""
        started = []
        while len(self.procs) < size:
            i = len(self.procs)
            self.tasks.append(self._mp.Queue())
            proc = self._mp.Process(target=_worker, args=(i, self.tasks[i], self.results))
            proc.daemon = True
            self.procs.append(proc)
            started.append(proc)
        for p in started:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dead(self, ranks) -> dict[int, str]:
        """{rank: how its worker ended} for those of ``ranks`` whose process has ended."""
        out = {}
        for rank in ranks:
            code = self.procs[rank].exitcode
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                out[rank] = (
                    f"its worker process ended ({how}) without reporting: a crash in native "
                    "code (faulthandler prints each thread's stack to the test's stderr)"
                )
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
        self.kill()


_POOL: _Pool | None = None


def _pool(world_size: int) -> _Pool:
    global _POOL
    if _POOL is None or not _POOL.alive():
        if _POOL is not None:
            _POOL.kill()
        _POOL = _Pool(max(initial_size(), world_size))
    _POOL.grow(world_size)
    return _POOL


def _discard_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.kill()
        _POOL = None


@atexit.register
def _shutdown() -> None:
    if _POOL is not None:
        _POOL.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    config: dict | None = None,
    timeout: float = 180.0,
    launch: bool = True,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; return each rank's result, in rank order.

    With ``launch=True`` each rank calls ``gridtrain.launch(config, ...)`` and
    then ``fn(ctx, *args, **kwargs)``; with ``launch=False`` it calls
    ``fn(rank, world_size, port, *args, **kwargs)`` and sets up nothing itself.
    ``backend``: what ``gridtrain.launch`` is given (``"staged"``: CUDA ranks sharing
    the GPU).
    ``fn`` must be a module-level function (it is pickled by name).
    """
    if not 1 <= world_size <= MAX_WORKERS:
        raise ValueError(f"world_size must be in [1, {MAX_WORKERS}], got {world_size}")
    pool = _pool(world_size)
    pool.calls += 1
    call_id = pool.calls
    port = free_port()
    for rank in range(world_size):
        task = (call_id, fn, rank, world_size, port, config, args, kwargs, launch, backend)
        pool.tasks[rank].put(task)

    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    last_report = time.monotonic()
    deadline = last_report + timeout
    while len(outputs) + len(failures) < world_size:
        # once a rank failed, each of the others gets GRACE_S after the previous report
        end = min(deadline, last_report + GRACE_S) if failures else deadline
        wait = end - time.monotonic()
        if wait <= 0:
            break
        try:
            cid, rank, ok, value = pool.results.get(timeout=min(wait, POLL_S))
        except queue.Empty:
            # a worker that died (SIGABRT, SIGSEGV) never reports: fail now, not at the timeout
            dead = pool.dead(set(range(world_size)) - set(outputs) - set(failures))
            if dead:
                failures.update(dead)
                last_report = time.monotonic()
            continue
        last_report = time.monotonic()
        if cid != call_id:  # a late answer from a discarded call
            continue
        # a tensor arrives as shared memory that holds one file descriptor open while it
        # lives; a module that caches its layouts' results would run out of descriptors
        (outputs if ok else failures)[rank] = owned(value) if ok else value

    if failures or len(outputs) < world_size:
        missing = sorted(set(range(world_size)) - set(outputs) - set(failures))
        if missing:  # a rank still inside the call (a collective, a hang): start afresh
            _discard_pool()
        if failures:
            rank = min(failures)
            stuck = f"; ranks {missing} did not finish" if missing else ""
            raise RuntimeError(
                f"rank {rank} of {world_size} failed{stuck}:\n{failures[rank]}"
            ) from None
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout}s")
    return [outputs[r] for r in range(world_size)]
