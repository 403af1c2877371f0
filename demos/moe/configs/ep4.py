"""WideNet ViT-MoE with experts spread over 4 process(es): launch 4 process(es).

gridtrain run --nproc_per_node 4 --config demos/moe/configs/ep4.py demos/moe/train.py --synthetic
"""

moe = dict(expert_parallel_size=4)  # experts per rank = NUM_EXPERTS / 4

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
