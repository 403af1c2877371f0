"""`make demo`: 8 CPU processes = 2 data-parallel replicas x 1D tensor parallelism 2
x 2 pipeline stages (1F1B, 4 micro-batches).

Sized to finish in a few minutes on a 2-core machine with a clearly falling loss
(byte-level cross entropy from ln 256 = 5.55 to about 2.6).
"""

PRESET = "tiny"
TRAIN_ITERS = 150
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
LR = 1e-3
SAMPLE_TOKENS = 160

parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
