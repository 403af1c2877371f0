"""Data parallel over 2 processes (`--nproc_per_node 2`): each gets half of every batch."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128
