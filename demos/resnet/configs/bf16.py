"""ResNet-18 with torch autocast bf16 (no loss scaling needed)."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.BF16)
