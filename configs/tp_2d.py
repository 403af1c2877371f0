"""2D tensor parallelism (Optimus / SUMMA) on a 2 x 2 grid: 4 processes, one model replica.

gridtrain run --nproc_per_node 4 --config configs/tp_2d.py train.py
Batches must be divisible by q = 2 (batch blocks over grid rows).
"""

parallel = dict(tensor=dict(size=4, mode="2d"))
