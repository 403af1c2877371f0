"""demos/hf_finetune end to end, shrunk: pre-train when the directory is empty, save it, fine-tune
under a pipeline (dict batches, lazy init, sliced loading), save the result, score it with
transformers, and fail the run (exit status 1) when the target is not reached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--pretrain_steps", "3", "--steps", "3", "--train_size", "64", "--test_size", "32"]


def _run(tmp_path: Path, config: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "gridtrain.cli", "run", "--nproc_per_node", "2",
        "--config", f"demos/hf_finetune/configs/{config}.py", "demos/hf_finetune/finetune.py",
        "--model_type", "llama", "--pretrained_path", str(tmp_path / "pre"), *TINY, *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_demo_pretrains_finetunes_and_fails_below_target(tmp_path):
    out = _run(tmp_path, "pp", "--target_acc", "1.01")  # unreachable: the run must fail
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert "saved the pre-trained model" in log and "FAILED: accuracy" in log, log[-3000:]
    config = json.loads((tmp_path / "pre" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    saved = tmp_path / "pre_finetuned"  # one file, or one per pipeline stage and an index
    assert (saved / "model.safetensors").is_file() or (
        saved / "model.safetensors.index.json"
    ).is_file()
    # a second run reuses the directory (no pre-training) and passes without a target
    out = _run(tmp_path, "sequence")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "saved the pre-trained model" not in log and "accuracy" in log, log[-3000:]
