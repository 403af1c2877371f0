"""2.5D tensor parallelism (Tesseract) with depth 1: one 2 x 2 grid, 4 processes (same as 2d).

gridtrain run --nproc_per_node 4 --config configs/tp_2p5d_depth1.py train.py
Batches must be divisible by depth x q = 2.
"""

parallel = dict(tensor=dict(size=4, mode="2.5d", depth=1))
