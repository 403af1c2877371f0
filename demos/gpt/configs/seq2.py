"""Sequence parallelism over 2 processes (`--nproc_per_node 2`): each holds half of every
sequence; attention is ring attention, weights are replicated."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(tensor=dict(size=2, mode="sequence"))
