"""What can go wrong with a checkpoint, as exception types a caller can tell apart.

Every one is a :class:`CheckpointError` (a ``ValueError``), raised on every rank alike.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the path."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds something other than tensors and plain values (it could run code)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose bytes are not the ones gridtrain wrote (truncated, altered)."""


class CheckpointTargetError(CheckpointError):
    """A save's target exists and is not a gridtrain checkpoint; nothing was written."""


__all__ = [
    "CheckpointError",
    "CheckpointTargetError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
]
