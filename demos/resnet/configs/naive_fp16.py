"""ResNet-18 as an fp16 model with fp32 master weights and a dynamic loss scaler."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
