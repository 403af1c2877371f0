"""Data parallel 2 x 2D tensor parallel (2 x 2 grid): 8 processes, two model replicas.

Tensor groups are adjacent ranks (0-3 and 4-7); the dataloader splits data over the two
replicas, each replica's batch is split over its grid rows.
gridtrain run --nproc_per_node 8 --config configs/dp2_tp_2d.py train.py
"""

parallel = dict(tensor=dict(size=4, mode="2d"))
