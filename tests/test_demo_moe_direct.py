"""``python demos/moe/train.py`` run directly is one process doing every rank's work: it says
which thread count it runs with and how to choose another (it used to run 20x slower than under
``gridtrain run`` without a word)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_moe_demo_run_directly_names_its_thread_count():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GRIDTRAIN_CONFIG")}
    argv = [sys.executable, "demos/moe/train.py", "--synthetic", "--steps", "1"]
    argv += ["--train_size", "64", "--test_size", "32", "--log_interval", "1"]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "one process with torch's default of" in text and "set OMP_NUM_THREADS" in text, text
    assert "step 1 loss" in text, text
