"""Sequence parallelism over 2 processes (`--nproc_per_node 2`): each holds half of every
window's positions; the model's own attention call becomes ring attention."""

parallel = dict(tensor=dict(size=2, mode="sequence"))
