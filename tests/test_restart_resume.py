"""A run that loses a rank restarts (torch's elastic agent through `gridtrain run --max-restarts`),
resumes from the newest complete sharded checkpoint and ends bit-identical to a run that
never failed (CPU, deterministic)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRIDTRAIN = [sys.executable, "-m", "gridtrain.cli"]
# dropout: the restarted run must also draw the masks the uninterrupted one drew
ARGS = "--steps 6 --batch-size 8 --seq-len 32 --eval-batches 1 --sample-tokens 2 --warmup 2"
ARGS += " --dropout 0.2"


def _run(tmp: Path, name: str, extra: list[str], launcher: list[str]) -> str:
    cmd = GRIDTRAIN + ["run", *launcher, "--nproc_per_node", "2"]
    cmd += ["--config", str(REPO / "demos/gpt/configs/none.py"), str(REPO / "demos/gpt/train.py")]
    cmd += ARGS.split() + ["--checkpoint", str(tmp / name), "--save-every", "2", *extra]
    out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_restarted_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
    clean = _run(tmp_path, "clean", ["--resume", "auto"], [])
    crashed = _run(
        tmp_path, "crashed", ["--resume", "auto", "--crash-at-step", "3"], ["--max-restarts", "1"]
    )
    assert "crashing after step 3" in crashed, "the failure really happened"
    assert "resumed from" in crashed and "at step 2" in crashed, "resumed from step 2's save"
    digests = [re.search(r"weights sha256 ([0-9a-f]{64})", t).group(1) for t in (clean, crashed)]
    # exact equality: same weights, optimizer state, LR schedule and data position after resume
    assert digests[0] == digests[1]
