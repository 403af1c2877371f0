"""ResNet-18 under ZeRO stage 2 (Colossal-AI's low_level_zero row with gradients sharded): fp16
model; fp32 masters, Adam state and reduced gradients sharded over the data-parallel ranks."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
zero = dict(stage=2)
