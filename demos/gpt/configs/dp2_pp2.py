"""2 data-parallel replicas x 2 pipeline stages (`--nproc_per_node 4`), 1F1B schedule.

Stage 0 holds the embedding and the first blocks, stage 1 the last blocks and
the head; the head's weight is tied to the token embedding, so the engine adds
PipelineSharedModuleGradientHandler to sum the tied gradients between stages.
"""

PRESET = "tiny"
TRAIN_ITERS = 200
GLOBAL_BATCH_SIZE = 16
SEQ_LEN = 128

parallel = dict(pipeline=2)
num_microbatches = 4  # each data-parallel rank's batch of 8 -> 4 micro-batches of 2
