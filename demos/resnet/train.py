"""Train ResNet-18 on CIFAR-10 with gridtrain: one process, or data parallel over many.

    python demos/resnet/train.py --config demos/resnet/configs/fp32.py
    gridtrain run --nproc_per_node 2 --config demos/resnet/configs/torch_fp16.py \\
        demos/resnet/train.py -c ./ckpt-fp16

The recipe is the seed's: batch 100 per data-parallel rank, Adam at 1e-3 times
the data-parallel size, MultiStepLR at epochs 20/40/60/80 by 1/3, 80 epochs.
"""

from __future__ import annotations

import argparse
import logging

import torch
from common import add_data_args, datasets, launch
from model import resnet18
from torch.optim.lr_scheduler import MultiStepLR

import gridtrain as gt
from gridtrain.engine import (
    AccuracyHook,
    CSVLogHook,
    LoadCheckpointHook,
    LogMetricByEpochHook,
    LossCurveHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    TensorboardHook,
    ThroughputHook,
    Trainer,
)

logger = logging.getLogger("gridtrain")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "-r", "--resume", type=int, default=-1, help="resume from this epoch's checkpoint"
    )
    parser.add_argument("-c", "--checkpoint", default="./checkpoint", help="checkpoint directory")
    parser.add_argument(
        "-i", "--interval", type=int, default=5, help="save every N epochs; 0 = never"
    )
    parser.add_argument(
        "--target_acc", type=float, default=None, help="fail unless test accuracy >= this"
    )
    parser.add_argument("--epochs", type=int, default=None, help="override the config's NUM_EPOCHS")
    parser.add_argument("--max_steps", type=int, default=None, help="stop after N optimizer steps")
    parser.add_argument("--test_interval", type=int, default=1, help="evaluate every N epochs")
    parser.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    parser.add_argument("--tensorboard", default=None, help="TensorBoard log directory")
    parser.add_argument("--csv", default=None, help="append every metric to this CSV file")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_data_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = launch(args)
    cfg = ctx.config
    train_set, test_set = datasets(args, ctx)

    model = resnet18(num_classes=10, stem=args.stem)
    # linear scaling rule: the global batch grows with the data-parallel size
    lr = cfg.LEARNING_RATE * ctx.data_parallel_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    lr_scheduler = MultiStepLR(optimizer, milestones=[20, 40, 60, 80], gamma=1 / 3)
    train_dl = gt.data.get_dataloader(train_set, cfg.BATCH_SIZE, shuffle=True, drop_last=True)
    test_dl = gt.data.get_dataloader(test_set, cfg.BATCH_SIZE, shuffle=False)
    # the scheduler stays out of initialize: LRSchedulerHook steps it per epoch, as the seed did
    engine, train_dl, test_dl, _ = gt.initialize(
        model, optimizer, torch.nn.CrossEntropyLoss(), train_dl, test_dl
    )

    hooks = [
        LossHook(),
        AccuracyHook(),
        LRSchedulerHook(lr_scheduler, by_epoch=True),
        ThroughputHook(),
        LogMetricByEpochHook(),
    ]
    if args.resume >= 0:
        hooks.append(LoadCheckpointHook(args.checkpoint, epoch=args.resume))
    if args.interval > 0:
        hooks.append(SaveCheckpointHook(args.interval, args.checkpoint))
    if args.tensorboard:
        hooks.append(TensorboardHook(args.tensorboard))
    if args.csv:
        hooks.append(CSVLogHook(args.csv))
    if args.plot:
        hooks.append(LossCurveHook(args.plot))

    if ctx.global_rank == 0:
        logger.info(
            "%r: %d train / %d test images, batch %d per data rank, lr %.3g",
            ctx,
            len(train_set),
            len(test_set),
            cfg.BATCH_SIZE,
            lr,
        )
    trainer = Trainer(engine, ctx)
    summary = trainer.fit(
        train_dl,
        epochs=args.epochs or cfg.NUM_EPOCHS,
        max_steps=args.max_steps,
        test_dataloader=test_dl,
        test_interval=args.test_interval,
        hooks=hooks,
        display_progress=not args.no_progress,
    )
    accuracy = summary["test"]["accuracy"]
    if ctx.global_rank == 0:
        logger.info("test accuracy %.2f %%", 100 * accuracy)
    gt.destroy()
    if args.target_acc is not None and accuracy < args.target_acc:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below --target_acc {args.target_acc}")


if __name__ == "__main__":
    main()
