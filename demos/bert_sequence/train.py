"""Pre-train BERT (masked LM + sentence order) with sequence parallelism; config.py sets the layout.

    gridtrain run --nproc_per_node 4 --config demos/bert_sequence/config.py \\
        demos/bert_sequence/train.py                       # synthetic data
    ... demos/bert_sequence/train.py --real                # Python's pydoc topics
    ... demos/bert_sequence/train.py --data corpus.txt     # any text file

The config's UPPER_CASE constants (TRAIN_ITERS, GLOBAL_BATCH_SIZE, SEQ_LENGTH,
HIDDEN_SIZE, ...) size the run; ``parallel`` can change (tensor size 2 -> 4,
pipeline 1 -> 2) with no other edit.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data as bert_data  # noqa: E402 - the demo's own modules, next to this file
import model as bert_model  # noqa: E402

import gridtrain as gt  # noqa: E402
from gridtrain.parallel import comm  # noqa: E402

PM = gt.ParallelMode
log = logging.getLogger("bert_sequence")


class AnnealingLR(LambdaLR):
    """Megatron's AnnealingLR (linear style): linear warm-up to ``max_lr`` over
    ``warmup_iters``, linear decay to ``min_lr`` at ``decay_iters``, ``min_lr`` after."""

    def __init__(
        self, optimizer, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int
    ):
        if not 0 <= min_lr <= max_lr:
            raise ValueError(f"AnnealingLR: need 0 <= min_lr <= max_lr, got {min_lr}, {max_lr}")
        if decay_iters < warmup_iters:
            raise ValueError(
                f"AnnealingLR: decay_iters {decay_iters} < warmup_iters {warmup_iters}"
            )
        floor = min_lr / max_lr if max_lr else 0.0

        def factor(step: int) -> float:
            if warmup_iters and step < warmup_iters:
                return (step + 1) / warmup_iters
            if step >= decay_iters:
                return floor
            ratio = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
            return floor + (1.0 - floor) * (1.0 - ratio)

        for group in optimizer.param_groups:
            group["lr"] = max_lr
        super().__init__(optimizer, factor)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="train on Python's pydoc topics text")
    parser.add_argument("--data", default=None, help="train on this text file (implies --real)")
    parser.add_argument("--steps", type=int, default=None, help="override TRAIN_ITERS")
    return parser.parse_args(argv)


def optimizer_for(model: torch.nn.Module, lr: float, weight_decay: float):
    """AdamW; no weight decay on biases and LayerNorm weights (as Megatron)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
    groups = [
        dict(params=decay, weight_decay=weight_decay),
        dict(params=no_decay, weight_decay=0.0),
    ]
    return torch.optim.AdamW(groups, lr=lr)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ctx = gt.launch_from_torch()  # the config given to `gridtrain run --config`
    cfg = ctx.config
    steps = args.steps or cfg.TRAIN_ITERS
    first = ctx.global_rank == 0
    if not first:
        logging.getLogger().setLevel(logging.WARNING)

    text = (
        bert_data.real_text(args.data)
        if (args.real or args.data)
        else bert_data.synthetic_text(200_000, seed=cfg.SEED)
    )
    split = int(len(text) * 0.9)
    dp = ctx.data_parallel_size
    if cfg.GLOBAL_BATCH_SIZE % dp:
        raise SystemExit(f"GLOBAL_BATCH_SIZE {cfg.GLOBAL_BATCH_SIZE} is not divisible by dp {dp}")
    train_ds = bert_data.SentenceOrderDataset(
        text[:split], cfg.SEQ_LENGTH, steps * cfg.GLOBAL_BATCH_SIZE, seed=cfg.SEED
    )
    eval_ds = bert_data.SentenceOrderDataset(
        text[split:], cfg.SEQ_LENGTH, cfg.EVAL_ITERS * cfg.GLOBAL_BATCH_SIZE, seed=cfg.SEED + 1
    )
    loader = dict(
        batch_size=cfg.GLOBAL_BATCH_SIZE // dp, collate_fn=bert_data.collate, drop_last=True
    )
    train_dl = gt.data.get_dataloader(train_ds, shuffle=True, seed=cfg.SEED, **loader)
    eval_dl = gt.data.get_dataloader(eval_ds, **loader)

    torch.manual_seed(cfg.SEED)  # same initial weights on every rank
    model = bert_model.Bert(
        bert_data.VOCAB_SIZE,
        cfg.HIDDEN_SIZE,
        cfg.DEPTH,
        cfg.NUM_ATTENTION_HEADS,
        cfg.SEQ_LENGTH,
        add_binary_head=cfg.ADD_BINARY_HEAD,
    )
    optimizer = optimizer_for(model, cfg.LR, cfg.WEIGHT_DECAY)
    warmup = int(cfg.WARMUP_FRACTION * cfg.DECAY_ITERS)
    scheduler = AnnealingLR(optimizer, cfg.LR, cfg.MIN_LR, warmup, cfg.DECAY_ITERS)
    engine, train_dl, eval_dl, scheduler = gt.initialize(
        model, optimizer, bert_model.BertLoss(), train_dl, eval_dl, lr_scheduler=scheduler
    )
    log.info(
        "BERT %d x %d, seq %d, global batch %d | %s | ring attention %s",
        cfg.DEPTH,
        cfg.HIDDEN_SIZE,
        cfg.SEQ_LENGTH,
        cfg.GLOBAL_BATCH_SIZE,
        ctx,
        cfg.parallel.tensor.ring_attention,
    )

    batches = iter(train_dl)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        engine.train()
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(batches, return_output_label=False)
        engine.step()
        loss = _data_mean(loss, ctx)
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  %.2fs%s",
            step,
            steps,
            loss,
            engine.optimizer.param_groups[0]["lr"],
            time.perf_counter() - start,
            "  (fp16 overflow: skipped)" if engine.last_step_skipped else "",
        )
        if step % cfg.EVAL_INTERVAL == 0 or step == steps:
            log.info("step %d  eval loss %.4f", step, evaluate(engine, eval_dl, ctx))
    gt.destroy()


def evaluate(engine, eval_dl, ctx) -> float:
    """Mean loss over the eval set (every data rank's share, averaged over data ranks)."""
    engine.eval()
    losses = []
    with torch.no_grad():
        for batch in eval_dl:
            _, _, loss = engine.execute_schedule(
                iter([batch]), forward_only=True, return_output_label=False
            )
            losses.append(float(loss))
    return _data_mean(torch.tensor(sum(losses) / max(1, len(losses))), ctx)


def _data_mean(loss: torch.Tensor, ctx) -> float:
    """The loss averaged over data-parallel ranks (each reports its own batch's mean)."""
    t = loss.detach().float().reshape(1).to(ctx.device).clone()
    comm.all_reduce_(t, ctx.group(PM.DATA))
    return t.item() / ctx.data_parallel_size


if __name__ == "__main__":
    main()
