"""ResNet-18 on CIFAR-10 in fp32; data parallel = the number of processes launched."""

BATCH_SIZE = 100  # per data-parallel rank, as in the seed
NUM_EPOCHS = 80
LEARNING_RATE = 1e-3  # for one rank; train.py scales it by the data-parallel size
