"""Checksums that turn every damaged byte of a checkpoint into an error instead of wrong numbers.

``torch.load`` checks none of its zip's CRCs and DCP keeps none, so a flipped bit in a tensor
would load silently. gridtrain adds CRC-32s of its own:

- dense file: torch's zip, sealed by a zip comment ``gridtrain-dense 1 crc32 XXXXXXXX`` that
  holds the CRC-32 of every byte before it, computed while ``torch.save`` streams (no
  read-back). The seal also marks the file as ours, one that a save may replace.
- sharded directory: every rank's files (and DCP's ``.metadata``), size and CRC-32, in the
  completion marker, whose text ends with the CRC-32 of itself.

Files written before the seals (a plain zip; a marker of one JSON line) still load, unchecked.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

from gridtrain.engine.checkpoint.errors import CorruptCheckpointError

SEAL = re.compile(rb"gridtrain-dense 1 crc32 ([0-9a-f]{8})")
SEAL_LEN = len(b"gridtrain-dense 1 crc32 ") + 8
EOCD, EOCD_LEN = b"PK\x05\x06", 22  # zip's end record; its last 2 bytes: the comment's length
BLOCK = 1 << 24


# ---- dense: a sealed zip ------------------------------------------------------------------------
class SealingWriter:
    """The binary file ``torch.save`` writes into: every byte goes on to ``f`` and into a
    CRC-32, all but the last two (the zip comment's length, which :meth:`seal` sets)."""

    def __init__(self, f):
        self.f = f
        self.crc = 0
        self.pending = b""  # the last two bytes so far, not yet in the CRC
        self.last = b""  # the last EOCD_LEN bytes so far
        self.error: OSError | None = None  # torch reports a failed write as "unexpected pos"

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self.f.write(view)
        except OSError as err:
            self.error = self.error or err
            raise
        if len(view) >= 2:
            self.crc = zlib.crc32(view[:-2], zlib.crc32(self.pending, self.crc))
            self.pending = bytes(view[-2:])
        else:
            joined = self.pending + bytes(view)
            self.crc = zlib.crc32(joined[:-2], self.crc)
            self.pending = joined[-2:]
        self.last = (self.last + bytes(view[-EOCD_LEN:]))[-EOCD_LEN:]
        return len(view)

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def seal(self) -> None:
        """Give the finished zip its comment: the CRC-32 of every byte before the comment."""
        if self.last[:4] != EOCD or self.pending != b"\0\0":
            raise RuntimeError("torch.save did not end its zip as expected; cannot seal it")
        length = SEAL_LEN.to_bytes(2, "little")
        crc = zlib.crc32(length, self.crc)
        self.f.seek(-2, os.SEEK_END)
        self.f.write(length + b"gridtrain-dense 1 crc32 " + f"{crc:08x}".encode())


def _crc_of(path: Path, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        while length > 0:
            block = f.read(min(BLOCK, length))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            length -= len(block)
    return crc


_ZIP_ENTRY = b"PK\x03\x04"  # a zip's first local file header


def starts_as_torch_zip(path: Path) -> bool:
    """Whether ``path`` starts as ``torch.save`` starts a file: a zip whose first entry is
    ``<archive>/data.pkl`` (so a dense checkpoint cut short still counts as one). Reads only
    its beginning."""
    try:
        with open(path, "rb") as f:
            head = f.read(30 + 256)
    except OSError:
        return False
    if len(head) < 30 or head[:4] != _ZIP_ENTRY:
        return False
    name_len = struct.unpack_from("<H", head, 26)[0]
    return head[30 : 30 + name_len].endswith(b"/data.pkl")


def dense_seal(path: Path) -> str:
    """'sealed', 'legacy' (a zip without a comment: gridtrain's files before the seal) or
    'none'. Reads only the end of the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - SEAL_LEN - EOCD_LEN))
            tail = f.read()
    except OSError:
        return "none"
    end = tail[-SEAL_LEN - EOCD_LEN :]
    if len(end) == SEAL_LEN + EOCD_LEN and end[:4] == EOCD and SEAL.fullmatch(end[EOCD_LEN:]):
        if end[EOCD_LEN - 2 : EOCD_LEN] == SEAL_LEN.to_bytes(2, "little"):
            return "sealed"
    if tail[-EOCD_LEN:][:4] == EOCD and tail[-2:] == b"\0\0":
        return "legacy"
    return "none"


def verify_dense(path: Path, what: str) -> bool:
    """Raise ``CorruptCheckpointError`` unless ``path`` is a sealed zip whose bytes match its
    seal; a legacy (unsealed) zip passes unchecked. Returns whether it was checked."""
    kind = dense_seal(path)
    if kind == "legacy":
        return False
    if kind == "none":
        raise CorruptCheckpointError(
            f"{what} is not a complete gridtrain checkpoint: its end is not gridtrain's seal "
            "(truncated, altered, or not written by gridtrain)"
        )
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(size - SEAL_LEN)
        want = int(SEAL.fullmatch(f.read())[1], 16)
    if _crc_of(path, size - SEAL_LEN) != want:
        raise CorruptCheckpointError(
            f"{what} is damaged: its CRC-32 does not match the one written with it"
        )
    return True


# ---- sharded: per-file CRCs in a self-checked marker --------------------------------------------
def digests(directory: Path, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of files in ``directory``."""
    out = {}
    for name in names:
        size = os.path.getsize(directory / name)
        out[name] = [size, _crc_of(directory / name, size)]
    return out


def marker_text(marker: dict[str, Any]) -> str:
    """The marker's JSON on one line, then a line with that line's CRC-32."""
    line = json.dumps(marker, sort_keys=True)
    return f"{line}\ncrc32 {zlib.crc32(line.encode()):08x}\n"


def parse_marker(text: bytes, what: str) -> dict[str, Any]:
    """The marker's dict; raises ``CorruptCheckpointError`` if its CRC line does not match."""
    lines = text.split(b"\n")
    sealed = (
        len(lines) == 3 and lines[2] == b"" and bool(re.fullmatch(rb"crc32 [0-9a-f]{8}", lines[1]))
    )
    if sealed and zlib.crc32(lines[0]) != int(lines[1][6:], 16):
        raise CorruptCheckpointError(f"{what}: its completion marker is damaged (CRC-32)")
    try:
        marker = json.loads(lines[0] if sealed else text)
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{what}: its completion marker is not JSON ({err})") from None
    if not isinstance(marker, dict):
        raise CorruptCheckpointError(f"{what}: its completion marker is not a JSON object")
    if sealed != ("files" in marker):
        raise CorruptCheckpointError(f"{what}: its completion marker is damaged")
    return marker


def check_files(directory: Path, listed: dict, names: list[str], what: str) -> str | None:
    """The first problem with ``names`` (a share of ``listed``) in ``directory``, or None."""
    for name in names:
        entry = listed[name]
        path = directory / name
        try:
            size = os.lstat(path).st_size
        except OSError:
            return f"{what}: '{name}' is missing"
        if size != entry[0]:
            return f"{what}: '{name}' has {size} bytes, {entry[0]} were written"
        if _crc_of(path, size) != entry[1]:
            return f"{what}: '{name}' is damaged: its CRC-32 does not match the one written"
    return None


def well_formed(listed: Any) -> bool:
    """``{name: [size, crc]}`` with plain file names (a damaged marker must not steer reads)."""
    return isinstance(listed, dict) and all(
        isinstance(k, str)
        and re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", k)
        and ".." not in k
        and isinstance(v, list)
        and len(v) == 2
        and all(type(x) is int and x >= 0 for x in v)
        for k, v in listed.items()
    )
