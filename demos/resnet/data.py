"""Datasets for the ResNet demo: CIFAR-10, Fashion-MNIST (offline fallback) or synthetic.

All three yield 3 x 32 x 32 float images and labels 0..9, so the model is the
same whichever is used. ``$DATA`` (default ./data) is where they are stored.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import Dataset, Subset

DEBIAN_FASHION_MNIST = Path(
    "/usr/share/datasets/fashion-mnist"
)  # apt-get install dataset-fashion-mnist
DATASETS = ("cifar10", "fashion-mnist", "synthetic")


class DataUnavailable(RuntimeError):
    """The dataset could not be found or downloaded; the message says what to do instead."""


def data_root() -> Path:
    return Path(os.environ.get("DATA", "./data"))


class SyntheticImages(Dataset):
    """A deterministic, learnable 10-class image set made here (no download).

    Each class is a fixed smooth random pattern (a 4 x 4 grid upsampled to
    32 x 32); a sample is its class pattern, circularly shifted by up to 4
    pixels, plus Gaussian noise of twice the pattern's amplitude. Sample ``i``
    is drawn from its own seeded generator, so every process and every run sees
    the same data, and ``split`` ("train" or "test") picks disjoint noise.
    """

    def __init__(self, size: int, split: str = "train", num_classes: int = 10, seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.size = size
        self.num_classes = num_classes
        self.base = seed * 1_000_003 + (0 if split == "train" else 500_000_003)
        g = torch.Generator().manual_seed(seed)
        grid = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.patterns = F.interpolate(grid, size=32, mode="bilinear", align_corners=False)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.base + index)
        label = int(torch.randint(self.num_classes, (), generator=g))
        dy, dx = (int(s) for s in torch.randint(-4, 5, (2,), generator=g))
        image = self.patterns[label].roll((dy, dx), dims=(1, 2))
        image = 0.5 * image + torch.randn(3, 32, 32, generator=g)
        return image, label


def _cifar10(train: bool) -> Dataset:
    if train:  # the seed's augmentation
        transform = T.Compose([T.Pad(4), T.RandomHorizontalFlip(), T.RandomCrop(32), T.ToTensor()])
    else:
        transform = T.ToTensor()
    try:
        return torchvision.datasets.CIFAR10(
            root=str(data_root()), train=train, transform=transform, download=True
        )
    except Exception as err:  # noqa: BLE001 - any download failure gets the same advice
        raise DataUnavailable(
            f"CIFAR-10 could not be had in DATA={data_root()} ({type(err).__name__}: {err}). "
            "Without network, train on Fashion-MNIST (--dataset fashion-mnist; on Debian "
            "`apt-get install dataset-fashion-mnist` puts it in "
            f"{DEBIAN_FASHION_MNIST}, else torchvision downloads it) or on the synthetic set "
            "(--synthetic)."
        ) from None


def _stage_fashion_mnist_archives(root: Path) -> None:
    """Unpack gzipped idx files (Debian's, or ones placed in $DATA/FashionMNIST/raw)
    where torchvision's FashionMNIST looks for raw files, so no download is tried."""
    raw = root / "FashionMNIST" / "raw"
    for gz in [*DEBIAN_FASHION_MNIST.glob("*-ubyte.gz"), *raw.glob("*-ubyte.gz")]:
        target = raw / gz.name[: -len(".gz")]
        if not target.exists():
            raw.mkdir(parents=True, exist_ok=True)
            with gzip.open(gz, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def _fashion_mnist(train: bool) -> Dataset:
    root = data_root()
    _stage_fashion_mnist_archives(root)
    # 28 x 28 grey -> 3 x 32 x 32, the CIFAR shape, so the model does not change
    steps = [T.Grayscale(num_output_channels=3), T.Pad(2)]
    if train:
        steps.append(T.RandomHorizontalFlip())
    transform = T.Compose([*steps, T.ToTensor()])
    try:
        return torchvision.datasets.FashionMNIST(
            root=str(root), train=train, transform=transform, download=True
        )
    except Exception as err:  # noqa: BLE001
        raise DataUnavailable(
            f"Fashion-MNIST is neither in {DEBIAN_FASHION_MNIST} (apt-get install "
            f"dataset-fashion-mnist) nor downloadable into DATA={root} "
            f"({type(err).__name__}: {err}); use --synthetic."
        ) from None


def build_datasets(
    name: str, train_size: int | None = None, test_size: int | None = None
) -> tuple[Dataset, Dataset]:
    """(train, test) of dataset ``name``, cut to the first ``train_size``/``test_size``."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    if name == "synthetic":
        train, test = (
            SyntheticImages(train_size or 10_000),
            SyntheticImages(test_size or 2_000, split="test"),
        )
        return train, test
    make = _cifar10 if name == "cifar10" else _fashion_mnist
    train, test = make(True), make(False)
    if train_size is not None:
        train = Subset(train, range(min(train_size, len(train))))
    if test_size is not None:
        test = Subset(test, range(min(test_size, len(test))))
    return train, test
