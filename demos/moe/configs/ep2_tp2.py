"""ep2.py plus 1d tensor parallelism of 2 for the non-expert layers: launch 4 processes
(data 2 x tensor 2; each tensor rank holds its data rank's experts whole)."""

parallel = dict(tensor=dict(size=2, mode="1d"))
moe = dict(expert_parallel_size=2)

BATCH_SIZE = 32
LEARNING_RATE = 1e-3
NUM_STEPS = 200
NUM_EXPERTS = 4
TOP_K = 2
DEPTH = 6
HIDDEN = 128
FFN = 256
HEADS = 4
CAPACITY_FACTOR = 1.25
AUX_LOSS_COEF = 1e-2
