"""benchmarks/hf_throughput.py in its CPU form (the GPU run uses the same code at 124M, bf16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_hf_throughput_cpu_form_prints_both_loops():
    cmd = [sys.executable, "benchmarks/hf_throughput.py", "--device", "cpu", "--steps", "2"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    engine = next(line for line in lines if line.startswith("engine"))
    assert any(line.startswith("plain") for line in lines)
    assert float(engine.split()[-1]) > 0  # the engine/plain ratio
    assert "GPT2LMHeadModel" in out.stdout
