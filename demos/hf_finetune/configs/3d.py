"""3D tensor parallelism on a 2 x 2 x 2 cube (`--nproc_per_node 8`)."""

parallel = dict(tensor=dict(size=8, mode="3d"))
