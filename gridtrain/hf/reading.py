"""Reading a Hugging Face directory that may have been crafted: only its own regular files.

A directory downloaded from anywhere is input, not code, and is read as such:

- the index's ``weight_map`` may name only files *of the directory*: a plain name (no
  ``/``, no ``..``, not absolute), and once opened the file must really lie in the
  directory. A symbolic link is followed only where it stays inside, or, in the Hugging
  Face cache's own layout (``snapshots/<revision>/NAME -> ../../blobs/<hash>``), into that
  repository's ``blobs``. Anything else is refused, naming the entry;
- every file is opened non-blocking and must be a regular file (a FIFO, a device or a
  socket is refused before anything reads from it, so a planted FIFO cannot hang the load:
  no collective runs meanwhile, so ``timeout_s`` would never fire);
- a ``safetensors`` error (a truncated or malformed file) is raised naming the file.

Every file is read through the descriptor opened and checked here (``/proc/self/fd/N``),
so what was checked is what is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from safetensors import SafetensorError, safe_open

T = TypeVar("T")
MAX_INDEX = 1 << 26  # an index is a few MB at most; a bigger one is not an index


class PretrainedFileError(ValueError):
    """A file of a Hugging Face directory is refused (it leaves the directory, is not a
    regular file) or cannot be read (a damaged safetensors file); the message names it."""


class Directory:
    """The files of one Hugging Face directory, opened safely. ``root`` is where to read
    (a pinned descriptor's path), ``where`` the directory's name for messages."""

    def __init__(self, root: Path, where: Path):
        self.root, self.where = root, where
        self._fds: dict[str, int] = {}

    def inside(self) -> list[Path]:
        """Where a link of the directory may lead: the directory (where it is now: a save may
        have renamed the pinned one since), and in the HF cache the repository's blobs."""
        real = Path(_real(self.root, self.where))
        if real.parent.name == "snapshots":  # the HF cache: snapshots/<rev>/x -> ../../blobs/h
            return [real, real.parent.parent / "blobs"]
        return [real]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def path(self, name: object, what: str) -> str:
        """A path that reads exactly the checked file ``name`` (``what``: who named it)."""
        if not isinstance(name, str) or not _plain(name):
            raise PretrainedFileError(
                f"load_pretrained: {what} names {str(name)[:200]!r}, which is not a file name "
                f"in '{self.where}' (a path, '..' or an absolute path): refused"
            )
        if name not in self._fds:
            self._fds[name] = self._open(name, what)
        proc = f"/proc/self/fd/{self._fds[name]}"
        return proc if os.path.exists(proc) else str(self.root / name)

    def _open(self, name: str, what: str) -> int:
        """Open ``name``: a plain entry without following anything (it is in the directory by
        its name), a link only to check where it leads."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
        link = os.path.islink(self.root / name)
        try:
            fd = os.open(self.root / name, flags | (0 if link else os.O_NOFOLLOW))
        except OSError as err:
            raise PretrainedFileError(
                f"load_pretrained: '{self.where / name}' ({what}) cannot be opened: {err.strerror}"
            ) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise PretrainedFileError(
                    f"load_pretrained: '{self.where / name}' ({what}) is {_kind(mode)}, not a "
                    "regular file: refused, nothing was read from it"
                )
            real = Path(_real(Path(f"/proc/self/fd/{fd}"), self.root / name))
            if link and not any(real == d or d in real.parents for d in self.inside()):
                raise PretrainedFileError(
                    f"load_pretrained: '{self.where / name}' ({what}) leads out of the "
                    f"directory, to '{real}': refused"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str, what: str, limit: int = MAX_INDEX) -> bytes:
        with open(self.path(name, what), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise PretrainedFileError(f"load_pretrained: '{self.where / name}' is too large")
        return data

    def safetensors(self, name: str, what: str, stack: contextlib.ExitStack):
        """``safe_open`` of the checked file ``name``, entered on ``stack``."""
        path = self.path(name, what)
        return self.read(name, lambda: stack.enter_context(safe_open(path, "pt")))

    def read(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()``, a safetensors error in it raised naming the file ``name``."""
        try:
            return fn()
        except SafetensorError as err:
            raise PretrainedFileError(
                f"load_pretrained: '{self.where / name}' cannot be read as safetensors: {err}"
            ) from None


def weight_map(d: Directory, index_name: str, single: str) -> dict[str, str]:
    """key -> file name, from the index (checked) or the single weight file."""
    if os.path.lexists(d.root / index_name):
        raw = d.read_bytes(index_name, "the index")
        try:
            index = json.loads(raw)
            mapping = index["weight_map"]
            if not isinstance(mapping, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as err:
            raise PretrainedFileError(
                f"load_pretrained: '{d.where / index_name}' is not a Hugging Face index: {err}"
            ) from None
        for key, name in mapping.items():
            d.path(name, f"the index's entry for {str(key)[:100]!r}")
        return dict(mapping)
    if not os.path.lexists(d.root / single):
        raise FileNotFoundError(
            f"{d.where} holds neither {index_name} nor {single}: not a Hugging Face model directory"
        )
    with contextlib.ExitStack() as stack:
        f = d.safetensors(single, "the weight file", stack)
        return dict.fromkeys(d.read(single, f.keys), single)


@contextlib.contextmanager
def opened(root: Path, where: Path) -> Iterator[Directory]:
    d = Directory(root, where)
    try:
        yield d
    finally:
        d.close()


def _plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def _real(path: Path, fallback: Path) -> str:
    """Where ``path`` (a /proc/self/fd link) really is; ``fallback`` resolved without /proc."""
    if str(path).startswith("/proc/self/fd/"):
        with contextlib.suppress(OSError):
            return os.readlink(path)
    return os.path.realpath(fallback)


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return word
    return "not a regular file"


__all__ = ["Directory", "PretrainedFileError", "opened", "weight_map"]
