"""Loading one version of a checkpoint while a save may be replacing it.

A save puts its new checkpoint at the path in one rename (``files.replace``) and then
deletes the old one. A reader that opened files by path could read the old marker and
the new shards, or rank 0 the old save and rank 1 the new one. So every rank opens the
checkpoint (file or directory) once, the ranks agree that they opened the same one (device
and inode), and everything is then read through that open descriptor
(``/proc/self/fd/N`` on Linux): the version the reader started with, whatever the path
names meanwhile. An open file outlives its deletion; a directory's files do not, so the
reader holds a shared ``flock`` on the directory and a save that replaced it leaves it
for a later save to delete (``files.remove_unread``). Where the file system has no locks, a
sharded load whose old directory was deleted under it fails, sees that the path now names
another checkpoint, and loads that one instead. A reader gets the old save or the new
one, never a mix.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from gridtrain.engine.checkpoint.errors import CheckpointError
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

logger = logging.getLogger("gridtrain")

ATTEMPTS = 5  # a save every few milliseconds could otherwise keep a reader retrying forever
T = TypeVar("T")


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _current(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _gather(obj, ctx: ParallelContext | None) -> list:
    if ctx is None or ctx.world_size(ParallelMode.GLOBAL) == 1 or not dist.is_initialized():
        return [obj]
    return comm.all_gather_object(obj, ctx.group(ParallelMode.GLOBAL))


def agree(error: BaseException | None, ctx: ParallelContext | None) -> None:
    """Collective: raise on every rank if any rank has an ``error`` (its own on that rank;
    elsewhere the lowest failing rank's, as the same type where it is a ``CheckpointError``
    or ``OSError``), so no rank walks into a collective that the others left."""
    found = _gather(None if error is None else (type(error), str(error)), ctx)
    if error is not None:
        raise error
    for entry in found:
        if entry is not None:
            kind, message = entry
            if issubclass(kind, CheckpointError | OSError):
                raise kind(message)
            raise CheckpointError(f"another rank failed: {kind.__name__}: {message}")


@contextlib.contextmanager
def pin(path: Path, ctx: ParallelContext | None) -> Iterator[tuple[Path, tuple[int, int]]]:
    """Collective: every rank opens ``path`` and all hold the same file or directory; yields
    (a path naming exactly what was opened, its identity) while the block runs."""
    for attempt in range(ATTEMPTS):
        fd, error = None, None
        try:  # O_NONBLOCK: a FIFO planted at the path must not block the open
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            _hold(fd)
        except OSError as err:
            error = err
        try:
            agree(error, ctx)
            seen = _gather(_identity(fd), ctx)
            if len(set(seen)) == 1 or attempt == ATTEMPTS - 1:
                if len(set(seen)) != 1:
                    raise CheckpointError(
                        f"load_checkpoint: '{path}' kept changing while the ranks opened it "
                        "(saves in quick succession); try again"
                    )
                yield _fd_path(fd, path), seen[0]
                return
        finally:
            if fd is not None:
                os.close(fd)
        time.sleep(0.01 * (attempt + 1))  # a save was swapping it in: let it finish


def _hold(fd: int) -> None:
    """A shared lock on a directory: a save that replaces it leaves it (and its files) for a
    later save to delete (``files.remove_unread``) until this reader closes it."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        with contextlib.suppress(OSError):  # a file system without locks: retries cover it
            fcntl.flock(fd, fcntl.LOCK_SH)


def _fd_path(fd: int, path: Path) -> Path:
    proc = Path(f"/proc/self/fd/{fd}")
    return proc if proc.exists() else path  # no /proc: by name (a save may still interleave)


def load(path: Path, ctx: ParallelContext, read: Callable[[Path], T]) -> T:
    """Collective: ``read(root)`` with ``root`` naming the pinned checkpoint. ``read`` must
    fail on every rank alike (``agree``); when it fails and ``path`` now names another
    checkpoint (a save replaced it meanwhile), that one is read instead."""
    for attempt in range(ATTEMPTS):
        with pin(path, ctx) as (root, identity):
            try:
                return read(root)
            except (CheckpointError, OSError):
                replaced = any(_gather(_current(path) != identity, ctx))
                if not replaced or attempt == ATTEMPTS - 1:
                    raise
        if ctx.global_rank == 0:
            logger.info(
                "load_checkpoint: '%s' was replaced while loading; loading the new one", path
            )
    raise AssertionError("unreachable")  # the last attempt returns or raises


__all__ = ["agree", "load", "pin"]
