"""WideNet ViT-MoE with experts spread over 1 process(es): launch 1 process(es).

gridtrain run --nproc_per_node 1 --config demos/moe/configs/ep1.py demos/moe/train.py --synthetic
"""

moe = dict(expert_parallel_size=1)  # experts per rank = NUM_EXPERTS / 1

BATCH_SIZE = 32  # per data-parallel rank
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
