"""Data parallel over 2 processes (`--nproc_per_node 2`): each gets half of every batch."""
