"""2 data-parallel replicas x 1D tensor parallelism 2 x 2 pipeline stages
(`--nproc_per_node 8`)."""

parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
