"""Gemini's CUDA paths (side streams, events, page-locked host segments, asynchronous copies):
``benchmarks/offload.py --quick`` on the test device, a tiny GPT through
``zero=dict(stage=3, offload=True)`` (the root chunk resident, the blocks streamed, two
micro-steps) against a float64 single-process loop, and the bytes moved per step against
``offload_plan``'s formula."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpu_env import ON_CUDA

REPO = Path(__file__).resolve().parents[2]


def test_gemini_on_the_device_equals_one_process_and_moves_what_the_formula_says():
    device = "cuda" if ON_CUDA else "cpu"
    cmd = [sys.executable, "benchmarks/offload.py", "--quick", "--device", device]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    # the script's own checks: loss and weights to float64 rounding, bytes equal to the formula;
    # bf16: loss near, bytes (bf16 gradients and uploads) equal to the formula
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and "check" not in ln]
    assert len(rows) == 7 and all(ln.rstrip().endswith("| yes |") for ln in rows), out.stdout
