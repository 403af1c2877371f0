"""Checkpoint files on disk: temporary names, atomic replacement, stale clean-up, safe unpickling.

Every checkpoint is written under a hidden temporary name in the target's own
directory and renamed over the target once complete, so a reader sees the old
checkpoint or the new one, never a partial one. The temporary name says who
made it (``.NAME.tmp-gt.PID@HOST.RANDOM``): the next save in that directory
removes those whose process is gone (same host) or that are older than
``STALE_S`` (another host), and finishes a replacement that a crash cut between
its two renames. Temporary files are created with ``O_EXCL`` (``tempfile``),
so a planted file or symbolic link is never opened, and no link is followed
when cleaning up: a link is unlinked itself.

Loading never runs code from a file: tensors and plain Python values only
(``torch.load(weights_only=True)`` for pickles inside checkpoints, and an
allow-list unpickler for DCP's ``.metadata``).
"""

from __future__ import annotations

import ctypes
import errno
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
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("gridtrain")

MARKER = "gridtrain_checkpoint.json"  # written last into a sharded checkpoint's directory
STALE_S = 3600.0  # a temporary of another host counts as abandoned after this long
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<kind>tmp|old)-gt\.(?P<pid>\d+)@(?P<host>[\w-]+)\.\w+$")
ZIP_MAGIC = b"PK\x03\x04"


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something other than tensors and plain values (it could run code)."""


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


# ---- atomic replacement -------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}): {os.strerror(err)}")


def replace(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` (file or directory) at ``path`` atomically, whatever was there.

    A file or link at ``path`` is replaced by one ``rename``. An existing directory is
    swapped with ``tmp`` by ``renameat2(RENAME_EXCHANGE)`` and then deleted; where the
    file system cannot exchange, it is first renamed aside (``.NAME.old-gt...``): a
    crash between the two renames leaves both complete, and the next save puts one back.
    """
    if not (os.path.lexists(path) and stat.S_ISDIR(os.lstat(path).st_mode)):
        os.replace(tmp, path)  # over a file or a link: replaces the entry, follows nothing
    elif _exchange(tmp, path):
        remove_entry(tmp)  # tmp now names the previous checkpoint
    else:
        aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path, "old")))
        os.rename(path, aside / "ckpt")
        os.rename(tmp, path)
        remove_entry(aside)
    fsync_dir(path.parent)


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


def is_complete_dir(path: Path) -> bool:
    """A directory (not a link) holding a sharded checkpoint's completion marker."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return stat.S_ISREG(os.lstat(path / MARKER).st_mode)
    except OSError:
        return False


def clean_stale(directory: Path) -> list[str]:
    """Remove abandoned temporaries of ours in ``directory``; returns the names handled.

    A complete temporary whose target is missing (a crash between the renames of
    ``replace``) is renamed into place instead of deleted.
    """
    handled = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return handled
    # a finished tmp is newer than an old copy put aside for the same target: handle it first
    entries.sort(key=lambda e: ".tmp-gt." not in e.name)
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match is None or not _stale(match, entry):
            continue
        target = directory / match["target"]
        found = Path(entry.path)
        if match["kind"] == "old" and is_complete_dir(found / "ckpt"):
            found = found / "ckpt"
        if not os.path.lexists(target) and is_complete_dir(found):
            os.rename(found, target)
            logger.warning(
                "checkpoint %s restored from an interrupted save (%s)", target, entry.name
            )
        remove_entry(Path(entry.path))
        handled.append(entry.name)
    if handled:
        fsync_dir(directory)
    return handled


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a fresh ``O_EXCL`` temporary beside ``path``, fsync, rename over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        replace(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


# DCP's .metadata is a plain pickle of these dataclasses; nothing else may be named in it
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "strided", "sparse_coo", "_mkldnn"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "copyreg": {"_reconstructor"},
    "builtins": {"object", "set", "frozenset", "dict", "list", "tuple", "getattr"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            if module == "builtins" and name == "getattr":
                return _safe_getattr
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unsupported global: {module}.{name}")


def _safe_getattr(obj: Any, name: str) -> Any:
    # enum members pickle as getattr(EnumClass, "NAME"); allow exactly that
    if isinstance(obj, type) and not name.startswith("_"):
        return getattr(obj, name)
    raise pickle.UnpicklingError(f"unsupported getattr({obj!r}, {name!r})")


def safe_load_metadata(file, what: str) -> Any:
    """Unpickle DCP metadata with only DCP's own metadata classes allowed."""
    try:
        return _MetadataUnpickler(file).load()
    except (pickle.UnpicklingError, AttributeError, TypeError, EOFError) as err:
        raise UnsafeCheckpointError(
            f"refusing to load {what}: its metadata is not plain DCP metadata ({err}); "
            "nothing was executed"
        ) from None


def is_dense_file(path: Path) -> bool:
    """A regular file (not a link) in torch's zip format."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(4) == ZIP_MAGIC
    except OSError:
        return False


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directly under ``directory`` (see ``latest_checkpoint``)."""
    directory = Path(directory)
    found = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        if entry.name.startswith("."):
            continue  # temporaries and hidden files
        path = Path(entry.path)
        if is_complete_dir(path):
            found.append((os.lstat(path / MARKER).st_mtime_ns, entry.name, path))
        elif is_dense_file(path):
            found.append((os.lstat(path).st_mtime_ns, entry.name, path))
    return max(found)[2] if found else None
