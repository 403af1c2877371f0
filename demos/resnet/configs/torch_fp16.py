"""ResNet-18 with torch autocast fp16 and GradScaler; data parallel = processes launched."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.TORCH)
