"""`make demo`: 8 CPU processes = 2 data-parallel replicas x 1D tensor parallelism 2
x 2 pipeline stages (1F1B, 4 micro-batches).

Sized to finish in a few minutes on a 2-core machine with a clearly falling loss
(byte-level cross entropy from ln 256 = 5.55 to about 2.6). On GPUs it trains in bf16
where they support it (fp32 on CPUs); `make demo` picks `demo_gpu1.py` on a machine with
1 to 7 GPUs (one process per GPU).
"""

import torch as _torch

PRESET = "tiny"
TRAIN_ITERS = 150
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
LR = 1e-3
SAMPLE_TOKENS = 160

parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
fp16 = dict(mode="bf16") if _torch.cuda.is_available() and _torch.cuda.is_bf16_supported() else None
