"""ResNet-18 the Gemini way (Colossal-AI's gemini row): ZeRO stage 3 with offload: parameters,
gradients and Adam state sharded over the data-parallel ranks and kept in CPU memory between
uses; fp16 compute, fp32 masters."""

from gridtrain.amp import AMP_TYPE

BATCH_SIZE = 100
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
zero = dict(stage=3, offload=True)
