"""ResNet-18 from torchvision, with the seed's ImageNet stem or a CIFAR stem."""

from __future__ import annotations

import torchvision
from torch import nn

STEMS = ("imagenet", "cifar")


def resnet18(num_classes: int = 10, stem: str = "imagenet") -> nn.Module:
    """``torchvision.models.resnet18``; ``stem="cifar"`` swaps the 7x7/2 conv and max-pool
    for one 3x3/1 conv, so 32 x 32 inputs keep their resolution (more accurate, ~15x
    the compute). The seed's table uses the unchanged ImageNet stem."""
    if stem not in STEMS:
        raise ValueError(f"stem must be one of {', '.join(STEMS)}, got {stem!r}")
    model = torchvision.models.resnet18(num_classes=num_classes)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model
