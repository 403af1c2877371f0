"""2D (SUMMA) tensor parallelism on a 2 x 2 grid (`--nproc_per_node 4`): the batch split
over grid rows, the hidden dim over grid columns."""

parallel = dict(tensor=dict(size=4, mode="2d"))
