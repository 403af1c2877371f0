"""Fine-tune a small Mixtral-style Hugging Face model with its experts spread over the GPUs.

    gridtrain run --nproc_per_node 4 --config demos/hf_moe/configs/ep2.py demos/hf_moe/finetune.py

Nothing is downloaded. When ``--path`` holds no model yet, rank 0 builds one from a
``MixtralConfig`` (bytes as tokens, 8 experts, top 2) and writes it with ``transformers``'
own ``save_pretrained``: the directory a user would have from the Hub (Mixtral's original
per-expert keys, which ``load_pretrained`` converts into the model's fused experts). Then,
in the layout the config names, the script does what the README shows for any Hugging Face model: build it
under ``gt.lazy_init``, ``gt.initialize``, ``gridtrain.hf.load_pretrained`` (each rank reads
only its experts), train next-byte prediction on Python's own help text with the model's
router loss (``output_router_logits``), log the loss, and save the result with
``gridtrain.hf.save_pretrained`` (the model's own dense keys). The expert layout is printed
from ``engine.plan``. The run fails (exit status 1) when the loss does not fall by
``--min_drop``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gridtrain as gt  # noqa: E402
import gridtrain.hf as gthf  # noqa: E402
from demos.gpt.data import VOCAB_SIZE, WindowDataset, load_corpus, split_corpus  # noqa: E402

logger = logging.getLogger("demos.hf_moe")
AUX_COEF = 0.02  # Mixtral's router_aux_loss_coef


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="/tmp/gt_hf_moe", help="the model's directory")
    p.add_argument("--steps", type=int, default=None, help="override NUM_STEPS")
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--min_drop", type=float, default=0.2, help="fail unless the loss falls so")
    return p.parse_args()


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256, router_aux_loss_coef=AUX_COEF,
        output_router_logits=True, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def ensure_model(path: Path, ctx) -> None:
    """Rank 0 builds and saves the model when ``path`` holds none; every rank then waits."""
    if ctx.global_rank == 0 and not (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mixtral_config())
        # transformers' default: Mixtral's original per-expert keys
        # (block_sparse_moe.experts.N.w1.weight), as hub checkpoints hold them;
        # load_pretrained converts them into the model's fused [experts, ...] tensors
        model.save_pretrained(path)
        logger.info("built a Mixtral-style model and saved it to %s", path)
    dist.barrier()


def loss_fn(out, labels):
    """Next-byte cross entropy (any layout's logits) plus the model's router loss."""
    logits = out.logits
    ce = gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return ce + AUX_COEF * out.aux_loss


def main() -> int:
    args = parse_args()
    ctx = gt.launch_from_torch()  # the config from gridtrain run --config
    level = logging.INFO if ctx.global_rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg, path = ctx.config, Path(args.path)
    ensure_model(path, ctx)

    from transformers import AutoConfig, AutoModelForCausalLM

    with gt.lazy_init():  # nothing allocated until each rank knows its experts
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.LEARNING_RATE, weight_decay=0.01)
    train, _ = split_corpus(load_corpus())
    train_dl = gt.data.get_dataloader(
        WindowDataset(train, cfg.SEQ_LEN), cfg.BATCH_SIZE, shuffle=True, drop_last=True
    )
    engine, train_dl, _, _ = gt.initialize(model, optimizer, loss_fn, train_dl)
    gthf.load_pretrained(engine.model, path)  # each rank reads only its slices
    logger.info("%r\n%s", ctx, engine.plan)

    losses = train_loop(engine, train_dl, ctx, args.steps or cfg.NUM_STEPS, args.log_interval)
    out = path.with_name(path.name + "_finetuned")
    gthf.save_pretrained(engine.model, out)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    logger.info("loss %.4f -> %.4f (first and last 5 steps); saved %s", first, last, out)
    gt.destroy()
    if last > first * (1 - args.min_drop):
        logger.error("FAILED: the loss fell by less than %.0f %%", 100 * args.min_drop)
        return 1
    return 0


def train_loop(engine, train_dl, ctx, steps: int, log_interval: int) -> list[float]:
    """``steps`` optimizer steps; the data-parallel mean loss of each."""
    engine.train()
    losses: list[float] = []
    group, d = ctx.group(gt.ParallelMode.DATA), ctx.world_size(gt.ParallelMode.DATA)
    while len(losses) < steps:
        for x, y in train_dl:
            x, y = x.to(ctx.device), y.to(ctx.device)
            engine.zero_grad()
            loss = engine.criterion(engine(input_ids=x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=group)
            losses.append(mean.item() / d)
            if len(losses) % log_interval == 0 or len(losses) == 1:
                logger.info("step %d loss %.4f", len(losses), losses[-1])
            if len(losses) == steps:
                break
    return losses


if __name__ == "__main__":
    sys.exit(main())
