"""2.5D tensor parallelism (Tesseract): depth 2 x a 2 x 2 grid, 8 processes, one model replica.

Each depth slice runs SUMMA on its own half of the batch; weights are replicated over
depth (each rank holds 1/4 of every sharded weight) and their gradients summed over it.
gridtrain run --nproc_per_node 8 --config configs/tp_2p5d_depth2.py train.py
Batches must be divisible by depth x q = 4.
"""

parallel = dict(tensor=dict(size=8, mode="2.5d", depth=2))
