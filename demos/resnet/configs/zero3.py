"""ResNet-18 under ZeRO stage 3 (FSDP2): parameters, gradients, fp32 masters and Adam state
sharded over the data-parallel ranks; fp16 compute."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
zero = dict(stage=3)
