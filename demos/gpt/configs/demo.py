"""`make demo`: 4 CPU processes = 2 data-parallel replicas x 1D tensor parallelism 2.

Sized to finish in a few minutes on a 2-core laptop with a clearly falling loss
(byte-level cross entropy from ln 256 = 5.55 to about 2.5).
"""

PRESET = "tiny"
TRAIN_ITERS = 150
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
LR = 1e-3
SAMPLE_TOKENS = 160

parallel = dict(tensor=dict(size=2, mode="1d"))
