"""The whole Hugging Face directory replaced at once: a save never leaves two exports mixed.

``save_pretrained`` writes every file of the new export (weights, index, ``config.json``)
into a fresh temporary directory beside the target (``.NAME.tmp-gt.PID@HOST.*``, which a
later save removes if this process dies: ``engine/checkpoint/files``), then swaps it with
the target in one ``renameat2(RENAME_EXCHANGE)`` and deletes the old one. Until the swap
the old export is untouched (a full disk, a crash, a failed rank: it still loads, whole);
after it the new one is there, whole. Files of the old directory that are not part of an
export (a tokenizer, ``generation_config.json``, a README, subdirectories) are linked into
the new one before the swap, so nothing a user put there is lost. ``load_pretrained`` reads
through one open descriptor of the directory, so a save that swaps it meanwhile cannot mix
its files either; ``transformers``' ``from_pretrained`` reads by path and may, if it reads
while a save swaps: save to a new directory when something may be reading.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from gridtrain.engine.checkpoint import files as ckpt_files

EXPORTED = re.compile(
    r"config\.json|model\.safetensors\.index\.json|model(-\d{5}-of-\d{5})?\.safetensors"
)


def check_target(directory: Path) -> None:
    """Refuse, before anything is written, a target the swap cannot or must not replace."""
    if os.path.lexists(directory) and not stat.S_ISDIR(os.lstat(directory).st_mode):
        what = "a symbolic link" if os.path.islink(directory) else "a file"
        raise ValueError(
            f"save_pretrained: '{directory}' is {what}, not a directory; nothing was written"
        )
    resolved, cwd = directory.resolve(), Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise ValueError(
            f"save_pretrained: '{directory}' holds the working directory, and a save replaces "
            "the whole directory at once; save into a directory below it"
        )


def make_temporary(directory: Path) -> Path:
    """The empty temporary directory beside ``directory`` that the new export is written into
    (stale ones of dead processes removed first), with the old directory's permissions."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    ckpt_files.clean_stale(directory.parent)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=ckpt_files.temp_prefix(directory)))
    try:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o777 & ~umask
    os.chmod(tmp, mode)
    return tmp


def carry_over(old: Path, new: Path) -> None:
    """Link (or copy) into ``new`` every entry of ``old`` that is not part of an export."""
    if not os.path.isdir(old):
        return
    for entry in os.scandir(old):
        if EXPORTED.fullmatch(entry.name) or entry.name.startswith(".") and "-gt." in entry.name:
            continue
        target = new / entry.name
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, target, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        else:
            _link_or_copy(entry.path, target)


def _link_or_copy(src: str, dst: str | os.PathLike) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def swap_in(tmp: Path, directory: Path) -> None:
    """Put the finished ``tmp`` at ``directory`` at once; delete what was there (unless a
    ``load_pretrained`` still reads it: then a later save does)."""
    for name in os.listdir(tmp):  # every file on disk before the directory appears
        path = tmp / name
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    ckpt_files.fsync_dir(tmp)
    if ckpt_files.put_new(tmp, directory):
        ckpt_files.fsync_dir(directory.parent)
        return
    if ckpt_files.exchange(tmp, directory):
        ckpt_files.fsync_dir(directory.parent)
        ckpt_files.remove_unread(tmp)  # now the old export
        return
    # no renameat2 (not Linux): two renames; a crash between them leaves both under
    # temporary names, the old one whole
    aside = Path(tempfile.mkdtemp(dir=directory.parent, prefix=ckpt_files.temp_prefix(directory)))
    os.rename(directory, aside / "old")
    os.rename(tmp, directory)
    ckpt_files.fsync_dir(directory.parent)
    ckpt_files.remove_entry(aside)


__all__ = ["carry_over", "check_target", "make_temporary", "swap_in"]
