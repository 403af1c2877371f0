"""1D tensor parallelism 2 x 2 pipeline stages (`--nproc_per_node 4`), interleaved 1F1B.

The tiny preset's 6 layers (embed, 4 blocks, head) are cut into 2 stages x 2
chunks: stage 0 runs chunks {embed, h0} and {h3}, stage 1 {h1, h2} and {head}.
"""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(pipeline=dict(size=2, num_chunks=2), tensor=dict(size=2, mode="1d"))
num_microbatches = 8  # interleaving needs a multiple of the pipeline size
