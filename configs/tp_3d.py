"""3D tensor parallelism (Bian et al.) on a 2 x 2 x 2 cube: 8 processes, one model replica.

gridtrain run --nproc_per_node 8 --config configs/tp_3d.py train.py
Batches must be divisible by d x d = 4 (rows split over the input axis, then over a
feature axis); hidden sizes by d^3 = 8 (each rank holds 1/8 of every weight).
"""

parallel = dict(tensor=dict(size=8, mode="3d"))
