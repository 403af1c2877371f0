"""What someone who rewrote files of a sharded checkpoint would do next: make its CRCs match.

CRC-32s catch damage, not forgery: after ``forge_marker`` only the loader's own checks stand
between a crafted file and the process (tests/test_checkpoint_security.py, _fuzz.py).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from gridtrain.engine.checkpoint.files import MARKER


def forge_marker(directory: Path) -> None:
    """List every file's current size and CRC-32 in the completion marker, and give the
    marker a matching CRC line."""
    path = Path(directory) / MARKER
    marker = json.loads(path.read_bytes().split(b"\n")[0])
    for name in marker["files"]:
        data = (Path(directory) / name).read_bytes()
        marker["files"][name] = [len(data), zlib.crc32(data)]
    line = json.dumps(marker, sort_keys=True)
    path.write_text(f"{line}\ncrc32 {zlib.crc32(line.encode()):08x}\n")
