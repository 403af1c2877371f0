"""No parallelism: one process (`gridtrain run --nproc_per_node 1`)."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
