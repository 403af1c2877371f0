"""2 pipeline stages (`--nproc_per_node 2`), 1F1B over 4 micro-batches of dict batches
(input_ids, attention_mask, labels); the mask travels to every stage."""

parallel = dict(pipeline=2)
num_microbatches = 4
