"""A Hugging Face run prints no torchao notices, and gridtrain's own warnings still show.

A fresh interpreter (the notices come once per process, at the import of torchao): it
imports gridtrain, builds a tiny GPT-2 with `fp8` set (which imports torchao too and, the
model having no wide Linear, logs gridtrain's own fp8 warning), and registers an Enum of its
own as a pytree constant, whose deprecation notice must still get through the filter.
"""

import subprocess
import sys
from pathlib import Path

from helpers.harness import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import enum, sys
import torch
import transformers as tf
import gridtrain as gt

ctx = gt.launch(dict(fp8=True), rank=0, world_size=1, host="127.0.0.1", port={port})
config = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                       bos_token_id=0, eos_token_id=0)
model = tf.GPT2LMHeadModel(config)
engine, *_ = gt.initialize(model, torch.optim.AdamW(model.parameters()), gt.nn.CrossEntropyLoss())


class Local(str, enum.Enum):
    A = "a"


torch.utils._pytree.register_constant(Local)
gt.destroy()
print("torchao enums imported:", "torchao.quantization.quantize_.common.kernel_preference"
      in sys.modules and "torchao.prototype.mx_formats.config" in sys.modules)
"""


def test_hf_run_has_no_torchao_notices_and_keeps_our_warnings():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(port=free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the notices had their cause: the modules that log them were imported
    assert "torchao enums imported: True" in run.stdout, run.stdout
    assert "KernelPreference" not in run.stderr and "ScaleCalculationMode" not in run.stderr
    assert "torchao" not in run.stderr, run.stderr
    assert "fp8: no nn.Linear layer" in run.stderr, "gridtrain's own warning must show"
    assert "<enum 'Local'> is an Enum subclass" in run.stderr, "only torchao's are dropped"
