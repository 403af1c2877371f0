"""Writing a sharded checkpoint: every rank hands DCP its shards, rank 0 finishes the directory.

The directory is written under a temporary name beside the target (``files``);
when every rank's data and DCP's ``.metadata`` are on disk, rank 0 writes the
completion marker (epoch, layout and every file's CRC-32, ``integrity``) and renames the
directory into place.
``async_save`` stages a CPU copy of this rank's state (the only stall), then DCP
writes in a background thread over a gloo group of its own, and the same
finishing step runs there; a :class:`CheckpointFuture` reports the end.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from gridtrain.engine.checkpoint import files, integrity
from gridtrain.engine.checkpoint.errors import CheckpointError, disk_full
from gridtrain.engine.checkpoint.sharded import FORMAT, VERSION, first_failure
from gridtrain.engine.checkpoint.state import layout
from gridtrain.launch import register_teardown
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode


def _save_planner() -> dcp.DefaultSavePlanner:
    return dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


_ASYNC_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FINISHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gridtrain-ckpt")
_PENDING: list[CheckpointFuture] = []
_LOCK = threading.Lock()


class CheckpointFuture:
    """An asynchronous save in flight: ``wait()`` returns the checkpoint's path once it is
    complete and in place on disk (raises what the save raised); ``done()`` does not block.

    The next ``save_checkpoint``/``load_checkpoint`` waits for it; wait yourself before
    ``gridtrain.destroy()`` (``wait_pending()``). ``stall_s``: how long ``save_checkpoint``
    blocked training (staging a CPU copy of this rank's state).
    """

    def __init__(self, future: Future, path: Path, stall_s: float):
        self._future = future
        self.path = path
        self.stall_s = stall_s

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"CheckpointFuture({str(self.path)!r}, {state})"


def wait_pending() -> None:
    """Wait for every asynchronous save of this process (raises the first failure)."""
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for future in pending:
        future.wait()


register_teardown(wait_pending)  # gridtrain.destroy(): saves in flight use the process groups


def _async_group(ctx: ParallelContext):
    """A gloo group of every rank for the background saves (collective on first use), so
    their collectives never interleave with training's on the default group."""
    if ctx not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[ctx] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[ctx]


def _agree(failed: bool, group, device) -> bool:
    """Barrier over ``group`` that also tells every rank whether any rank failed."""
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    comm.all_reduce_(flag, group)
    return flag.item() > 0


def on_rank0(fn: Callable[[], Any], ctx: ParallelContext) -> Any:
    """Collective: run ``fn`` on global rank 0 only; every rank returns what it returned or
    raises what it raised (rank 0 the error itself, the others the same type and message
    where it is a ``CheckpointError`` or ``OSError``, else a ``RuntimeError`` naming it)."""
    out: list[Any] = [None]
    error = None
    if ctx.global_rank == 0:
        try:
            out[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, not hang
            error = err
            out[0] = ("error", type(err), str(err))
    if ctx.world_size(ParallelMode.GLOBAL) > 1:
        dist.broadcast_object_list(out, src=0, group=ctx.group(ParallelMode.GLOBAL))
    if error is not None:
        raise error
    if out[0][0] == "ok":
        return out[0][1]
    kind, message = out[0][1], out[0][2]
    if issubclass(kind, CheckpointError | OSError):
        raise kind(message)
    raise RuntimeError(f"rank 0 failed: {kind.__name__}: {message}")


def _prepare(path: Path, ctx: ParallelContext) -> Path:
    """Rank 0 checks the target, cleans up and creates the temporary directory; every rank
    learns its name (or rank 0's error)."""

    def make() -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.clean_stale(path.parent)
        files.check_target(path)
        return tempfile.mkdtemp(dir=path.parent, prefix=files.temp_prefix(path))

    return Path(on_rank0(make, ctx))


def _own_files(tmp: Path, rank: int) -> dict[str, list[int]] | str:
    """Size and CRC-32 of the files this rank wrote (rank 0: DCP's .metadata too), or what
    went wrong reading them back."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
        return integrity.digests(tmp, sorted(names) + ([".metadata"] if rank == 0 else []))
    except OSError as err:
        return f"rank {rank} cannot read back what it wrote: {err}"


def _finish(tmp: Path, path: Path, epoch: int, ctx: ParallelContext, group, saved_ok: bool):
    """After DCP wrote everything: rank 0 lists every rank's files with their CRC-32 in the
    completion marker, and renames the directory into place."""
    if group is None:
        group, device = ctx.group(ParallelMode.GLOBAL), ctx.device
    else:
        device = torch.device("cpu")
    listed = comm.all_gather_object(_own_files(tmp, ctx.global_rank) if saved_ok else {}, group)
    error = None
    if ctx.global_rank == 0:
        try:
            unread = [x for x in listed if isinstance(x, str)]
            if unread:
                raise OSError(unread[0])
            if saved_ok:
                marker = {"format": FORMAT, "version": VERSION, "epoch": epoch}
                marker.update(
                    layout=layout(ctx), files={k: v for d in listed for k, v in d.items()}
                )
                files.write_marker(tmp, integrity.marker_text(marker))
                files.replace(tmp, path)
            else:
                files.remove_entry(tmp)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, not hang
            error = disk_full(err, path, "save_checkpoint") or err
            files.remove_entry(tmp)
    if _agree(error is not None, group, device):
        raise error or RuntimeError(f"save_checkpoint: rank 0 failed to finish '{path}'")
    return path


class _Stream:
    """A file DCP writes into that keeps the first ``OSError`` of a write (torch's zip writer,
    which DCP's tensors go through, reports a failed write only as ``unexpected pos``)."""

    def __init__(self, stream, errors: list[OSError]):
        self._stream, self._errors = stream, errors

    def _keep(self, fn, *args):
        try:
            return fn(*args)
        except OSError as err:
            self._errors.append(err)
            raise

    def write(self, data):
        return self._keep(self._stream.write, data)

    def flush(self):
        return self._keep(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _FileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            yield _Stream(stream, self.errors) if "w" in mode else stream


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer; a disk that fills up is an ``OSError`` saying so and naming the
    target (``errors.disk_full``), on every rank, rather than torch's ``unexpected pos``."""

    def __init__(self, tmp: Path, target: Path):
        super().__init__(tmp, single_file_per_rank=True, sync_files=True)
        self.fs = _FileSystem()
        self.target = target

    def _full(self, err: BaseException) -> BaseException:
        for cause in [*self.fs.errors, err]:
            full = disk_full(cause, self.target, "save_checkpoint")
            if full is not None:
                return full
        return err

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            raise self._full(err) from err

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as err:
            raise self._full(err) from err


def _writer(tmp: Path, target: Path) -> dcp.FileSystemWriter:
    return _Writer(tmp, target)


def save(path: Path, epoch: int, state: dict, ctx: ParallelContext, async_save: bool):
    """Collective: write ``state`` (from ``state_dict``) as a complete directory at ``path``."""
    wait_pending()
    tmp = _prepare(path, ctx)
    if not async_save:
        try:
            dcp.save(state, storage_writer=_writer(tmp, path), planner=_save_planner())
        except BaseException as err:
            if ctx.global_rank == 0:
                files.remove_entry(tmp)
            if isinstance(err, CheckpointException):
                raise first_failure(err) from err
            raise
        return _finish(tmp, path, epoch, ctx, None, True)

    group = _async_group(ctx)
    start = time.perf_counter()
    stager = DefaultStager(StagingOptions(ctx.device.type == "cuda", False, False, False))
    upload = dcp.async_save(
        state,
        storage_writer=_writer(tmp, path),
        planner=_save_planner(),
        process_group=group,
        async_stager=stager,
    )
    stall = time.perf_counter() - start

    def finish() -> Path:
        try:
            upload.result()
            ok = True
        except BaseException:  # noqa: BLE001 - reported through _finish to every rank
            ok = False
        finally:
            stager.close()
        _finish(tmp, path, epoch, ctx, group, ok)
        if not ok:
            try:
                upload.result()
            except CheckpointException as err:
                raise first_failure(err) from err
        return path

    future = CheckpointFuture(_FINISHER.submit(finish), path, stall)
    with _LOCK:
        _PENDING.append(future)
    return future


__all__ = ["CheckpointFuture", "on_rank0", "save", "wait_pending"]
