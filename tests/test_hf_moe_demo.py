"""demos/hf_moe end to end, shrunk: the demo builds and saves its Mixtral-style model, fine-tunes
it with the experts spread over 2 ranks (``gridtrain run --nproc_per_node 2 --config
demos/hf_moe/configs/ep2.py``), prints the expert layout from ``engine.plan``, the loss falls,
and the saved directory is the model's own (``transformers`` reads every expert back)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_builds_finetunes_and_saves_with_experts_spread(tmp_path):
    path = tmp_path / "mixtral"
    cmd = [
        sys.executable, "-m", "gridtrain.cli", "run", "--nproc_per_node", "2",
        "--config", "demos/hf_moe/configs/ep2.py", "demos/hf_moe/finetune.py",
        "--path", str(path), "--steps", "12", "--log_interval", "4", "--min_drop", "0.1",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "built a Mixtral-style model" in log, log[-3000:]
    # the plan's expert table: 8 experts per layer, this rank (0) holds 0-3
    assert "moe.expert_parallel_size 2" in log, log[-3000:]
    assert "model.layers.0.mlp.experts  8        0-3" in log, log[-3000:]

    import torch
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral_finetuned").state_dict()
    base = AutoModelForCausalLM.from_pretrained(path).state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert tuned[key].shape == base[key].shape and tuned[key].shape[0] == 8
    assert not torch.equal(tuned[key][7], base[key][7]), "rank 1's experts were trained and saved"
