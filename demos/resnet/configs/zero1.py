"""ResNet-18 under ZeRO stage 1 (Colossal-AI's low_level_zero row): fp16 model; the fp32
masters and Adam state sharded over the data-parallel ranks."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
zero = dict(stage=1)
