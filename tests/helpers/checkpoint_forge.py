"""What an attacker or a careless user does to checkpoints, for the checkpoint safety tests.

``forge_marker``: what someone who rewrote files of a sharded checkpoint would do next, make
its CRCs match. CRC-32s catch damage, not forgery: after it only the loader's own checks
stand between a crafted file and the process (tests/test_checkpoint_security.py, _fuzz.py).
``temp_name`` and ``dead_pid``: a planted temporary name of a process that no longer runs.
"""

from __future__ import annotations

import json
import subprocess
import zlib
from pathlib import Path

import torch

from gridtrain.engine.checkpoint import files


def forge_marker(directory: Path) -> None:
    """List every file's current size and CRC-32 in the completion marker, and give the
    marker a matching CRC line."""
    path = Path(directory) / files.MARKER
    marker = json.loads(path.read_bytes().split(b"\n")[0])
    for name in marker["files"]:
        data = (Path(directory) / name).read_bytes()
        marker["files"][name] = [len(data), zlib.crc32(data)]
    line = json.dumps(marker, sort_keys=True)
    path.write_text(f"{line}\ncrc32 {zlib.crc32(line.encode()):08x}\n")


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny model and optimizer every checkpoint safety test saves and loads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def temp_name(target: str, pid: int, host: str | None = None, kind: str = "tmp") -> str:
    """The name gridtrain gives a temporary (``kind`` tmp) or an old copy (``old``) of
    ``target`` written by ``pid`` on ``host`` (default: this host, as gridtrain spells it)."""
    return f".{target}.{kind}-gt.{pid}@{host or files._host()}.abc123"
