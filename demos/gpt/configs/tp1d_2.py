"""1D (Megatron) tensor parallelism over 2 processes (`--nproc_per_node 2`)."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(tensor=dict(size=2, mode="1d"))
