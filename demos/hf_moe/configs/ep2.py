"""A Mixtral-style model with its experts spread over 2 rank(s) of each data-parallel group.

gridtrain run --nproc_per_node 4 --config demos/hf_moe/configs/ep2.py demos/hf_moe/finetune.py
"""

moe = dict(expert_parallel_size=2)  # experts per rank = num_local_experts / 2

BATCH_SIZE = 8  # sequences per data-parallel rank
SEQ_LEN = 64  # bytes per sequence
LEARNING_RATE = 3e-3
NUM_STEPS = 60
