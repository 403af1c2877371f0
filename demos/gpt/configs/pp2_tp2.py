"""2 pipeline stages x 1D tensor parallelism 2 (`--nproc_per_node 4`): embedding and the
first blocks on stage 0, the rest and the tied head on stage 1 (the tie is kept by the
engine's shared-weight gradient handler)."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
