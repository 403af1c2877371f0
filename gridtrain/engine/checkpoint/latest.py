"""The newest intact checkpoint in a directory: what an automatic resume starts from.

Candidates are the entries directly in the directory that a save of ours leaves: a
sharded directory (with its completion marker, or one that holds DCP's files but lost its
marker) and a dense file (torch's zip, recognised by its first entry, sealed or not).
They are tried newest first (by the time the marker or the file was written) and each is
*verified*, every byte against the CRC-32s written with it (``integrity``), not merely
found: the first intact one wins. Every newer one that is damaged is skipped with a
warning naming it and why, so a crash that left the latest checkpoint truncated, or a
bad block in one shard, costs the steps since the previous checkpoint and nothing more.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from gridtrain.engine.checkpoint import files, integrity
from gridtrain.engine.checkpoint.errors import CheckpointError
from gridtrain.engine.checkpoint.sharded import read_marker

logger = logging.getLogger("gridtrain")


def candidates(directory: Path) -> list[tuple[int, str, Path]]:
    """(time written in ns, name, path) of every entry that looks like a checkpoint of ours."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if entry.name.startswith("."):
            continue  # temporaries and hidden files
        path = Path(entry.path)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            if files.is_complete_dir(path):
                found.append((os.lstat(path / files.MARKER).st_mtime_ns, entry.name, path))
            elif _looks_sharded(path):
                found.append((os.lstat(path).st_mtime_ns, entry.name, path))
        elif stat.S_ISREG(mode) and integrity.starts_as_torch_zip(path):
            found.append((os.lstat(path).st_mtime_ns, entry.name, path))
    return sorted(found, reverse=True)


def _looks_sharded(path: Path) -> bool:
    try:
        return any(n == ".metadata" or n.endswith(".distcp") for n in os.listdir(path))
    except OSError:
        return False


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded (truncated, a byte changed, a file
    missing, no completion marker), or None when every byte is the one written. Reads it all."""
    what = f"'{path}'"
    try:
        if os.path.isdir(path):
            marker = read_marker(path)
            listed = marker.get("files")
            if listed is None:
                return None  # written before the CRCs: nothing to check against
            if not integrity.well_formed(listed):
                return f"{what}: its file list is damaged"
            return integrity.check_files(path, listed, sorted(listed), what)
        if integrity.dense_seal(path) == "legacy":
            return None if files.is_dense_file(path) else f"{what} is not a gridtrain checkpoint"
        integrity.verify_dense(path, what)
    except (CheckpointError, OSError) as err:
        return str(err)
    return None


def newest_intact(directory: str | os.PathLike, verify: bool = True) -> Path | None:
    """The newest checkpoint in ``directory`` that :func:`damage` finds intact (``verify=False``:
    the newest complete one, unread); every newer damaged one is logged and skipped."""
    skipped = 0
    for _, _, path in candidates(Path(directory)):
        if not verify:
            if files.is_complete_dir(path) or files.is_dense_file(path):
                return path
            continue
        reason = damage(path)
        if reason is None:
            return path
        skipped += 1
        logger.warning(
            "latest_checkpoint: skipping the damaged checkpoint '%s': %s; trying the one before it",
            path,
            reason,
        )
    if skipped:
        logger.warning(
            "latest_checkpoint: no intact checkpoint in '%s' (%d damaged)", directory, skipped
        )
    return None


__all__ = ["candidates", "damage", "newest_intact"]
