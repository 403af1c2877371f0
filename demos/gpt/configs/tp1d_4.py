"""1D (Megatron) tensor parallelism over 4 processes (`--nproc_per_node 4`): one head each."""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(tensor=dict(size=4, mode="1d"))
