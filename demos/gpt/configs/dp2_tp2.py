"""2 data-parallel replicas x 1D tensor parallelism 2 (`--nproc_per_node 4`)."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(tensor=dict(size=2, mode="1d"))
