"""Each precision keeps its own compiled graphs when processes share torch.compile's on-disk cache.

torch 2.11's AOTAutograd cache keyed a graph by whether autocast was on, not by its dtype: on an
H100 a ``bf16`` run after a ``torch`` fp16 run on the same machine loaded the fp16 graphs and
trained in fp16 (its losses close enough to pass). gridtrain skips that cache under autocast
where the key lacks the dtype (``gridtrain/engine/compile_cache.py``). Here three processes
share one fresh cache directory and run ``test_gpu_precision``'s parity check (output dtype,
losses and updates against float64) in turn: torch fp16, bf16, torch fp16. Without the guard on
torch 2.11, the bf16 process fails with fp16 outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpu_env import REPO

PRECISION = Path(__file__).with_name("test_gpu_precision.py")


def test_processes_sharing_a_compile_cache_keep_their_own_precision(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for mode in ("torch fp16", "bf16", "torch fp16"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rfE",
                f"{PRECISION}::test_precision_mode_tracks_float64[{mode}]",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{mode} after the others, one cache:\n{done.stdout[-3000:]}"
