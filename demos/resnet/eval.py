"""Evaluate a ResNet-18 checkpoint written by train.py on the test set.

python demos/resnet/eval.py -c ./checkpoint -e 80
"""

from __future__ import annotations

import argparse
import logging

import torch
from common import add_data_args, datasets, launch
from model import resnet18

import gridtrain as gt
from gridtrain.engine import AccuracyHook, LossHook, Trainer, epoch_checkpoints

logger = logging.getLogger("gridtrain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-e", "--epoch", type=int, default=80, help="the checkpoint's epoch")
    parser.add_argument("-c", "--checkpoint", default="./checkpoint", help="checkpoint directory")
    add_data_args(parser)
    args = parser.parse_args()

    ctx = launch(args)
    _, test_set = datasets(args, ctx)
    path = epoch_checkpoints(args.checkpoint).get(args.epoch)  # dense file or sharded dir
    if path is None:
        raise SystemExit(f"no complete checkpoint for epoch {args.epoch} in {args.checkpoint}")
    model = resnet18(num_classes=10, stem=args.stem)
    gt.load_checkpoint(path, model)
    test_dl = gt.data.get_dataloader(test_set, ctx.config.BATCH_SIZE, shuffle=False)
    engine, _, test_dl, _ = gt.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        torch.nn.CrossEntropyLoss(),
        test_dataloader=test_dl,
    )
    metrics = Trainer(engine, ctx).evaluate(test_dl, hooks=[LossHook(), AccuracyHook()])
    if ctx.global_rank == 0:
        logger.info(
            "Accuracy of the model on the test images: %.2f %% (loss %.4f, epoch %d)",
            100 * metrics["accuracy"],
            metrics["loss"],
            args.epoch,
        )
    gt.destroy()


if __name__ == "__main__":
    main()
