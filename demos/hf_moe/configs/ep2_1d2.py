"""Experts over 2 ranks, attention and the dense layers split over 2 more (1d tensor parallel).

gridtrain run --nproc_per_node 4 --config demos/hf_moe/configs/ep2_1d2.py demos/hf_moe/finetune.py
"""

parallel = dict(tensor=dict(size=2, mode="1d"))
moe = dict(expert_parallel_size=2)  # the 2 data ranks (4 ranks / tensor 2) hold 4 experts each

BATCH_SIZE = 8  # sequences per data-parallel rank
SEQ_LEN = 64  # bytes per sequence
LEARNING_RATE = 3e-3
NUM_STEPS = 60
