"""`make demo` on a machine with 1 to 7 GPUs: the demo's model and schedule on one process,
bf16 where the GPU supports it."""

import torch as _torch

PRESET = "tiny"
TRAIN_ITERS = 150
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
LR = 1e-3
SAMPLE_TOKENS = 160

fp16 = dict(mode="bf16") if _torch.cuda.is_bf16_supported() else None
