"""What can go wrong with a checkpoint, as exception types a caller can tell apart.

Every one is a :class:`CheckpointError` (a ``ValueError``), raised on every rank alike.
"""

from __future__ import annotations

import errno
import os

FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota on it, is full


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the path."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds something other than tensors and plain values (it could run code)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose bytes are not the ones gridtrain wrote (truncated, altered)."""


class CheckpointTargetError(CheckpointError):
    """A save's target exists and is not a gridtrain checkpoint; nothing was written."""


def disk_full(err: BaseException | None, path: str | os.PathLike, what: str) -> OSError | None:
    """An ``OSError`` that says the disk holding ``path`` is full, if ``err`` is one (ENOSPC,
    EDQUOT), else None. torch's zip writer turns a failed write into ``unexpected pos``;
    gridtrain's writers keep the ``OSError`` itself and hand it here."""
    if not isinstance(err, OSError) or err.errno not in FULL:
        return None
    which = "quota" if err.errno == errno.EDQUOT else "disk"
    return OSError(
        err.errno,
        f"{what}: the {which} holding '{path}' is full ({os.strerror(err.errno)}); nothing was "
        f"replaced, what was at '{path}' before is intact. Free some space and save again",
    )


__all__ = [
    "CheckpointError",
    "CheckpointTargetError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "disk_full",
]
