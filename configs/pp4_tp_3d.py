"""4 pipeline stages x 3D tensor parallelism (a 2 x 2 x 2 cube): 32 processes per model replica.

The data-parallel size is world / 32: `gridtrain topo --config configs/pp4_tp_3d.py
--world-size 1024` shows the groups of 32 replicas. Batches divide by d x d = 4, hidden
sizes by d^3 = 8 (see configs/tp_3d.py).
"""

parallel = dict(pipeline=4, tensor=dict(size=8, mode="3d"))
num_microbatches = 8  # 1F1B over 4 stages: an idle fraction of 3 / (8 + 3)
