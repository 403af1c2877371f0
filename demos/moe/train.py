"""Train the WideNet ViT-MoE on CIFAR-10, Fashion-MNIST or synthetic images with gridtrain.

    python demos/moe/train.py --synthetic --steps 20                      # 1 process, ep 1
    gridtrain run --nproc_per_node 4 --config demos/moe/configs/ep4.py \\
        demos/moe/train.py --dataset cifar10

Every ``--log_interval`` steps rank 0 logs the loss, the MoE auxiliary loss, the
tokens each expert received (summed over the data ranks) and how many token
choices were dropped for lack of capacity.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import gridtrain as gt  # noqa: E402
from demos.moe.model import MoeCriterion, WideNet, WideNetConfig  # noqa: E402
from demos.resnet.data import DATASETS, build_datasets  # noqa: E402
from gridtrain.parallel import comm, moe  # noqa: E402

logger = logging.getLogger("gridtrain")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="default: configs/ep1.py on one process")
    parser.add_argument("--dataset", choices=DATASETS, default="cifar10")
    parser.add_argument("--synthetic", action="store_true", help="same as --dataset synthetic")
    parser.add_argument("--train_size", type=int, default=None)
    parser.add_argument("--test_size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="override NUM_STEPS")
    parser.add_argument("--log_interval", type=int, default=10)
    parser.add_argument("--checkpoint", default=None, help="save the final checkpoint here")
    return parser.parse_args()


def launch(args) -> gt.ParallelContext:
    direct = "RANK" not in os.environ  # `python demos/moe/train.py`: one process
    config = args.config or (str(HERE / "configs" / "ep1.py") if direct else None)
    ctx = gt.launch_from_torch(config=config)
    level = logging.INFO if ctx.global_rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if direct and "OMP_NUM_THREADS" not in os.environ:
        logger.info(THREADS_NOTICE, torch.get_num_threads())
    return ctx


# run directly, the one process does every rank's work with torch's default thread count,
# which on a machine shared with other jobs can be far slower than gridtrain run's processes
THREADS_NOTICE = (
    "one process with torch's default of %d threads (OMP_NUM_THREADS unset); gridtrain run "
    "gives each of several processes 1 thread: set OMP_NUM_THREADS to choose"
)


def model_config(cfg, in_chans: int = 3) -> WideNetConfig:
    return WideNetConfig(
        in_chans=in_chans,
        depth=cfg.DEPTH,
        hidden=cfg.HIDDEN,
        heads=cfg.HEADS,
        ffn=cfg.FFN,
        num_experts=cfg.NUM_EXPERTS,
        top_k=cfg.TOP_K,
        capacity_factor_train=cfg.CAPACITY_FACTOR,
        aux_loss_coef=cfg.AUX_LOSS_COEF,
    )


def evaluate(engine, model, test_dl, ctx) -> float:
    engine.eval()
    correct = torch.zeros(2, device=ctx.device)
    with torch.no_grad():
        for x, y in test_dl:
            out = engine(x.to(ctx.device))
            correct += torch.tensor(
                [(out.argmax(-1) == y.to(ctx.device)).sum(), len(y)], device=ctx.device
            )
    moe.clear_aux_loss(model)
    comm.all_reduce_(correct, ctx.group(gt.ParallelMode.DATA))
    engine.train()
    return (correct[0] / correct[1]).item()


def main() -> None:
    args = parse_args()
    ctx = launch(args)
    cfg = ctx.config
    name = "synthetic" if args.synthetic else args.dataset
    train_set, test_set = build_datasets(name, args.train_size, args.test_size)

    torch.manual_seed(0)  # equal dense weights on every rank, whatever the layout
    model = WideNet(model_config(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.LEARNING_RATE, weight_decay=0.05)
    train_dl = gt.data.get_dataloader(train_set, cfg.BATCH_SIZE, shuffle=True, drop_last=True)
    test_dl = gt.data.get_dataloader(test_set, cfg.BATCH_SIZE)
    engine, train_dl, test_dl, _ = gt.initialize(
        model, optimizer, MoeCriterion(model), train_dl, test_dl
    )
    logger.info(
        "%r: WideNet %s, %d experts (%d per rank), batch %d per data rank",
        ctx,
        model.cfg,
        model.cfg.num_experts,
        model.moe.experts.num_local_experts,
        cfg.BATCH_SIZE,
    )
    steps = args.steps or cfg.NUM_STEPS
    engine.train()
    step, start, tokens = 0, time.perf_counter(), 0
    data_group = ctx.group(gt.ParallelMode.DATA)
    while step < steps:
        for x, y in train_dl:
            x, y = x.to(ctx.device), y.to(ctx.device)
            engine.zero_grad()
            out = engine(x)
            aux = moe.pending_aux_loss(model)
            loss = engine.criterion(out, y)  # task loss + aux loss of this forward
            engine.backward(loss)
            engine.step()
            step += 1
            tokens += x.shape[0] * (1 + (model.cfg.img_size // model.cfg.patch_size) ** 2)
            if step % args.log_interval == 0 or step == steps:
                load, dropped = moe.expert_load(model)
                stats = torch.cat([load, torch.tensor([float(dropped), loss.item(), float(aux)])])
                stats = stats.to(ctx.device)
                comm.all_reduce_(stats, data_group)
                d = ctx.world_size(gt.ParallelMode.DATA)
                load = stats[:-3].round().int().tolist()
                logger.info(
                    "step %d loss %.4f aux %.4f expert load %s dropped %d tokens/s %.0f",
                    step,
                    stats[-2].item() / d,
                    stats[-1].item() / d,
                    load,
                    int(stats[-3].item()),
                    tokens * d / (time.perf_counter() - start),
                )
            if step >= steps:
                break
    accuracy = evaluate(engine, model, test_dl, ctx)
    logger.info("test accuracy %.2f %%", 100 * accuracy)
    if args.checkpoint:
        gt.save_checkpoint(args.checkpoint, 1, engine.model, engine.optimizer)
        logger.info("saved %s", args.checkpoint)
    gt.destroy()


if __name__ == "__main__":
    main()
