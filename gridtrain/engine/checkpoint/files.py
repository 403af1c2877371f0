"""Checkpoint files on disk: temporary names, atomic replacement, stale clean-up, safe unpickling.

Every checkpoint is written under a hidden temporary name in the target's own
directory and renamed over the target once complete, so a reader sees the old
checkpoint or the new one, never a partial one. A save replaces only a checkpoint
of ours (a sealed dense file, a directory with the completion marker) or an empty
directory; anything else at the target is refused before anything is written, and
checked again, atomically, as it is swapped out. The temporary name says who made
it (``.NAME.tmp-gt.PID@HOST.RANDOM``): the next save in that directory removes
those whose process is gone (same host) or that are older than ``STALE_S``
(another host), and finishes a replacement that a crash cut between its two
renames; a replaced directory that a load still reads (``pinned`` holds a shared ``flock``
on it) is left to a later save. Temporary files are created with ``O_EXCL`` (``tempfile``), so a planted
file or link is never opened, and clean-up never follows a link: entries are
examined with ``lstat`` and opened with ``O_NOFOLLOW``, and a link is unlinked itself.

Loading never runs code from a file: tensors and plain Python values only
(``torch.load(weights_only=True)`` for pickles inside checkpoints; ``dcp_metadata``
for DCP's ``.metadata``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import logging
import os
import pickle
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gridtrain.engine.checkpoint import integrity
from gridtrain.engine.checkpoint.errors import (
    CheckpointError,
    CheckpointTargetError,
    UnsafeCheckpointError,
    disk_full,
)

logger = logging.getLogger("gridtrain")

MARKER = "gridtrain_checkpoint.json"  # written last into a sharded checkpoint's directory
STALE_S = 3600.0  # a temporary of another host counts as abandoned after this long
# fullmatch, DOTALL: a target name may hold any character but '/', a newline included
_TEMP = re.compile(
    r"\.(?P<target>.+)\.(?P<kind>tmp|old)-gt\.(?P<pid>\d+)@(?P<host>[\w-]+)\.\w+", re.DOTALL
)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def _host() -> str:
    return re.sub(r"[^\w-]", "_", socket.gethostname()) or "host"


def temp_prefix(path: Path, kind: str = "tmp") -> str:
    """Prefix of this process's temporaries for ``path`` (``tempfile`` appends a random part)."""
    return f".{path.name}.{kind}-gt.{os.getpid()}@{_host()}."


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_entry(path: Path) -> None:
    """Delete a file, an empty or full directory, or a link (the link itself, never its target)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # never follows links inside (fd-based on Linux)
    else:
        path.unlink(missing_ok=True)


def remove_unread(path: Path) -> bool:
    """``remove_entry``, unless a reader holds the directory ``path`` (a shared ``flock``,
    taken by ``pinned``: a load in progress): then it stays, under its temporary name, for
    a later save's ``clean_stale``. Returns whether it was removed."""
    with _open_dir(path) as fd:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError:
                pass  # a file system without locks: readers retry instead (``pinned``)
        remove_entry(path)
    return True


@contextlib.contextmanager
def _open_dir(name: str | os.PathLike, dir_fd: int | None = None) -> Iterator[int | None]:
    """A descriptor of directory ``name`` opened without following a link; None if it is not
    a directory (a link to one included)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _complete_at(name: str | os.PathLike, dir_fd: int | None = None) -> bool:
    with _open_dir(name, dir_fd) as fd:
        if fd is None:
            return False
        try:
            return stat.S_ISREG(os.stat(MARKER, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError:
            return False


def is_complete_dir(path: Path) -> bool:
    """A directory (not a link) holding a sharded checkpoint's completion marker."""
    return _complete_at(path)


def is_dense_file(path: Path) -> bool:
    """A regular file (not a link) sealed as a gridtrain dense checkpoint, or one from before
    the seal (a torch zip whose pickle is our payload: checked without running code)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    kind = integrity.dense_seal(path)
    if kind != "legacy":
        return kind == "sealed"
    try:  # mmap: the tensors are not read
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - whatever it is, it is not ours
        return False
    return isinstance(ckpt, dict) and ckpt.get("format") == 1 and "epoch" in ckpt


def _cut_short_dense(path: Path) -> bool:
    """A regular file that starts as ``torch.save`` starts one and ends neither with our seal
    nor with a zip's end: a dense checkpoint cut short or damaged at its end (a crash, a full
    disk, a bad block). ``latest_checkpoint`` skips it; the resumed run that saves the same
    name again must be able to replace it."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return integrity.dense_seal(path) == "none" and integrity.starts_as_torch_zip(path)


def _ours(path: Path) -> bool:
    """What a save may replace: a checkpoint of ours (whole, or a dense one cut short) or an
    empty directory (nothing is lost)."""
    if is_complete_dir(path) or is_dense_file(path) or _cut_short_dense(path):
        return True
    with _open_dir(path) as fd:
        return fd is not None and not os.listdir(fd)


def check_target(path: Path) -> None:
    """Raise ``CheckpointTargetError`` (naming ``path``) if something that is not a checkpoint
    of ours is there: a save would delete it."""
    if os.path.lexists(path) and not _ours(path):
        if os.path.islink(path):
            what = "a symbolic link"
        else:
            what = "a directory" if os.path.isdir(path) else "a file"
        raise CheckpointTargetError(
            f"save_checkpoint: '{path}' is {what} that is not a gridtrain checkpoint; a save "
            "replaces only a checkpoint it wrote (or an empty directory), so nothing was "
            "written. Choose another path or remove it yourself"
        )


# ---- atomic replacement -------------------------------------------------------------------
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2 (atomic: NOREPLACE fails if ``b`` exists, EXCHANGE swaps ``a`` and
    ``b``); False where the system lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}): {os.strerror(err)}", str(b))


def _exchange(a: Path, b: Path) -> bool:
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _put_new(tmp: Path, path: Path) -> bool:
    """Rename ``tmp`` to ``path`` only while nothing is there; False if something is."""
    try:
        if _renameat2(tmp, path, _RENAME_NOREPLACE):
            return True
    except FileExistsError:
        return False
    if os.path.lexists(path):  # no renameat2: check, then rename (a narrow window)
        return False
    os.rename(tmp, path)
    return True


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot."""
    return _exchange(a, b)


def put_new(tmp: Path, path: Path) -> bool:
    """Rename ``tmp`` to ``path`` only while nothing is there; False if something is."""
    return _put_new(tmp, path)


def replace(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` (file or directory) at ``path`` atomically.

    Nothing at ``path``: one rename. A checkpoint of ours there: swapped with ``tmp`` by
    ``renameat2(RENAME_EXCHANGE)``, checked again (a swap that brought back anything else is
    undone, and ``CheckpointTargetError`` raised), then deleted. Where the file system cannot
    exchange, the old one is first renamed aside (``.NAME.old-gt...``): a crash between the
    two renames leaves both complete, and the next save puts one back.
    """
    if not _put_new(tmp, path):
        check_target(path)
        if _exchange(tmp, path):
            if not _ours(tmp):  # tmp now names what was at path: it changed since the check
                _exchange(tmp, path)
                check_target(path)
            remove_unread(tmp)  # the old checkpoint: kept while a load reads it
        else:
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path, "old")))
            os.rename(path, aside / "ckpt")
            os.rename(tmp, path)
            remove_entry(aside)
    fsync_dir(path.parent)


# ---- stale temporaries --------------------------------------------------------------------
def _stale(match: re.Match, entry: os.DirEntry) -> bool:
    if match["host"] == _host():
        pid = int(match["pid"])
        if pid == os.getpid():
            return True  # ours, left by a failed save (pending async saves were waited for)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_S
    except OSError:
        return False


def _restorable(name: str, dir_fd: int, path: Path) -> bool:
    """A complete checkpoint at ``name`` (in ``dir_fd``): a marked directory, or a sealed
    dense file whose CRC-32 matches (reading it through ``path`` moves nothing)."""
    if _complete_at(name, dir_fd):
        return True
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        return integrity.verify_dense(path, str(path))
    except (OSError, CheckpointError):
        return False


def _restore(entry: os.DirEntry, kind: str, target: str, directory: Path, dir_fd: int) -> bool:
    """Rename the complete checkpoint in a stale temporary to its missing ``target``; every
    step relative to opened directories, so no link on the way is followed."""
    here = directory / entry.name
    if entry.is_symlink() or os.path.lexists(directory / target):
        return False
    if kind == "old":  # the previous checkpoint, put aside
        with _open_dir(entry.name, dir_fd) as fd:
            if fd is not None and _restorable("ckpt", fd, here / "ckpt"):
                os.rename("ckpt", target, src_dir_fd=fd, dst_dir_fd=dir_fd)
                return True
        return False
    if _restorable(entry.name, dir_fd, here):  # finished, never renamed
        os.rename(entry.name, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    return False


def clean_stale(directory: Path) -> list[str]:
    """Remove abandoned temporaries of ours in ``directory``; returns the names handled.

    A complete temporary whose target is missing (a crash between the renames of
    ``replace``) is renamed into place instead of deleted. A link is only unlinked.
    """
    handled = []
    with _open_dir(directory) as dir_fd:
        if dir_fd is None:
            return handled
        entries = list(os.scandir(dir_fd))
        # a finished tmp is newer than an old copy put aside for the same target: handle it first
        entries.sort(key=lambda e: ".tmp-gt." not in e.name)
        for entry in entries:
            match = _TEMP.fullmatch(entry.name)
            if match is None or not _stale(match, entry):
                continue
            if _restore(entry, match["kind"], match["target"], directory, dir_fd):
                logger.warning(
                    "checkpoint %s restored from an interrupted save (%s)",
                    directory / match["target"],
                    entry.name,
                )
            if remove_unread(directory / entry.name):
                handled.append(entry.name)
    if handled:
        fsync_dir(directory)
    return handled


@contextlib.contextmanager
def atomic_file(path: Path, put: Callable[[Path, Path], None] = replace) -> Iterator:
    """A binary file that appears at ``path`` only once complete: written to a fresh
    ``O_EXCL`` temporary of ours beside it (``temp_prefix``: a later save's ``clean_stale``
    removes it if this process dies), synced, then ``put`` over ``path`` (``replace``:
    refuses a target that is not ours)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path))
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        put(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through ``atomic_file``, sealed with its CRC-32 (``integrity``)."""
    check_target(path)
    sealing = None
    try:
        with atomic_file(path) as f:
            sealing = integrity.SealingWriter(f)
            torch.save(obj, sealing)
            sealing.seal()
    except (OSError, RuntimeError) as err:
        full = disk_full(getattr(sealing, "error", None) or err, path, "save_checkpoint")
        if full is None:
            raise
        raise full from err


def write_marker(directory: Path, text: str) -> None:
    """The completion marker: created exclusively, written and synced before the rename."""
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


# ---- safe loading -------------------------------------------------------------------------
def safe_torch_load(source: str | os.PathLike | io.BytesIO, what: str) -> Any:
    """``torch.load(weights_only=True)``; a file that needs anything else is refused by name."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message: a general paragraph, what it refused, a pointer to the docs
        middle = [p.strip() for p in str(err).split("\n\n")[1:-1] if p.strip()]
        reason = f"Refused: {' '.join(middle)}" if middle else ""
        raise UnsafeCheckpointError(
            f"refusing to load {what}: it holds objects other than tensors and plain Python "
            f"values, which could run code when unpickled; nothing was executed. {reason}".strip()
        ) from None
