"""What train.py and eval.py share: launching (one process or many) and the data."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

import torch
from data import DATASETS, DataUnavailable, build_datasets

import gridtrain as gt
from gridtrain.parallel.comm import all_reduce_max

HERE = Path(__file__).resolve().parent


def add_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="config file (default: the one `gridtrain run --config` names, else configs/fp32.py)",
    )
    parser.add_argument("--dataset", choices=DATASETS, default="cifar10")
    parser.add_argument(
        "--synthetic", action="store_true", help="same as --dataset synthetic (no download)"
    )
    parser.add_argument("--train_size", type=int, default=None, help="use the first N train images")
    parser.add_argument("--test_size", type=int, default=None, help="use the first N test images")
    parser.add_argument("--stem", choices=("imagenet", "cifar"), default="imagenet")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> gt.ParallelContext:
    """Under `gridtrain run`/torchrun: join the job; run plainly: a world of one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ctx = gt.launch_from_torch(config=args.config)
    else:
        config = args.config or str(HERE / "configs" / "fp32.py")
        ctx = gt.launch(config, rank=0, world_size=1, host="127.0.0.1", port=_free_port())
    level = logging.INFO if ctx.global_rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return ctx


def datasets(args: argparse.Namespace, ctx: gt.ParallelContext):
    """(train, test) datasets; rank 0 downloads or stages files first, the others then read."""
    name = "synthetic" if args.synthetic else args.dataset
    built, error = None, None
    if ctx.global_rank == 0:
        try:
            built = build_datasets(name, args.train_size, args.test_size)
        except DataUnavailable as err:
            error = err
    failed = torch.tensor([1.0 if error else 0.0], device=ctx.device)
    if all_reduce_max(failed, ctx.group(gt.ParallelMode.GLOBAL)).item():
        raise SystemExit(str(error) if error else f"rank 0 could not prepare {name}; see its log")
    return built or build_datasets(name, args.train_size, args.test_size)
