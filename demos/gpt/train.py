"""Train a GPT-2 family model with gridtrain; the config file picks the parallel layout.

    gridtrain run --nproc_per_node 4 --config demos/gpt/configs/demo.py demos/gpt/train.py
    gridtrain run --nproc_per_node 1 --config demos/gpt/configs/none.py demos/gpt/train.py \\
        --preset small --seq-len 1024 --batch-size 8 --data my.txt
    gridtrain run --max-restarts 3 --nproc_per_node 4 --config demos/gpt/configs/dp2_tp2.py \\
        demos/gpt/train.py --checkpoint ckpt --save-every 20 --resume auto

Command-line arguments override the config's UPPER_CASE constants (PRESET,
TRAIN_ITERS, GLOBAL_BATCH_SIZE, SEQ_LEN, LR, ...), which override the defaults.
``--batch-size`` is the global batch: each data-parallel rank gets its share.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import gridtrain as gt  # noqa: E402
from demos.config_args import config_parser, fill_from_config  # noqa: E402
from demos.gpt import data as gpt_data  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402
from gridtrain.parallel import comm  # noqa: E402

PM = gt.ParallelMode

# (argument, config constant, type, default, help)
ARGS = [
    ("preset", "PRESET", str, "tiny", "model size: tiny, small (124M) or medium (350M)"),
    ("steps", "TRAIN_ITERS", int, 200, "optimizer steps"),
    ("batch_size", "GLOBAL_BATCH_SIZE", int, 16, "sequences per step over all data ranks"),
    ("seq_len", "SEQ_LEN", int, 128, "tokens per sequence"),
    ("lr", "LR", float, 1e-3, "peak learning rate (linear warm-up, cosine decay to lr/10)"),
    ("warmup", "WARMUP_ITERS", int, 10, "warm-up steps"),
    ("weight_decay", "WEIGHT_DECAY", float, 0.1, "AdamW decay of matrices"),
    ("dropout", "DROPOUT", float, 0.0, "dropout probability"),
    ("eval_batches", "EVAL_BATCHES", int, 8, "held-out batches evaluated at the end"),
    ("sample_tokens", "SAMPLE_TOKENS", int, 200, "tokens generated at the end"),
    ("data", "DATA", str, None, "text file to train on (default: Python's pydoc topics)"),
    ("plot", "PLOT", str, None, "save the loss curve to this image (matplotlib)"),
    ("seed", "SEED", int, 0, "weight-init and sampling seed"),
]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line alone (before any launch, so ``--help`` needs no config)."""
    parser = config_parser(__doc__.split("\n")[0], ARGS)
    parser.add_argument("--prompt", default="The ", help="text the sample continues")
    parser.add_argument("--checkpoint", default=None, help="directory of sharded checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
    parser.add_argument(
        "--resume", default=None, help="'auto' (newest complete checkpoint) or a path"
    )
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=0,
        help="testing restarts: the last rank exits with code 1 after this step, first attempt only",
    )
    return parser.parse_args(argv)


def with_config(args: argparse.Namespace, config) -> argparse.Namespace:
    """Fill what the command line left unset from the config's constants, then check it."""
    fill_from_config(args, config, ARGS)
    for name in ("steps", "batch_size", "seq_len", "eval_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def make_loader(dataset, batch_size: int, shuffle: bool, ctx: gt.ParallelContext):
    """Each data-parallel rank's share of every global batch (same on a tensor group)."""
    dp = ctx.data_parallel_size
    if batch_size % dp:
        raise SystemExit(f"--batch-size {batch_size} is not divisible by data-parallel size {dp}")
    return gt.data.get_dataloader(dataset, batch_size // dp, shuffle=shuffle, drop_last=True)


def forever(loader):
    """Batches from ``loader`` epoch after epoch (reshuffled through the sampler's epoch)."""
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def mean_loss(loss, ctx: gt.ParallelContext) -> float:
    """Mean over every rank that computed a loss (pipeline: last stages only; tensor ranks
    hold equal copies), i.e. the global batch's mean loss."""
    t = torch.zeros(2, device=ctx.device)
    if loss is not None:
        t[0], t[1] = loss.detach().float(), 1.0
    comm.all_reduce_(t, ctx.group(PM.GLOBAL))
    return (t[0] / t[1]).item()


def lr_lambda(args):
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(model, args):
    """AdamW, decaying matrices only (GPT-2 / nanoGPT practice)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
        dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
    ]
    fused = dict(fused=True) if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **fused)


@torch.no_grad()
def evaluate(engine, loader, batches: int, ctx) -> float:
    engine.eval()
    losses = []
    for _, batch in zip(range(batches), forever(loader)):
        _, _, loss = engine.execute_schedule(
            iter([batch]), forward_only=True, return_loss=True, return_output_label=False
        )
        losses.append(mean_loss(loss, ctx))
    engine.train()
    return sum(losses) / len(losses)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ctx = gt.launch_from_torch()
    args = with_config(args, ctx.config)
    rank0 = ctx.global_rank == 0
    train_tokens, val_tokens = gpt_data.split_corpus(gpt_data.load_corpus(args.data))
    cfg = gpt_model.preset(
        args.preset,
        vocab_size=gpt_data.VOCAB_SIZE,
        block_size=max(args.seq_len, 1),
        dropout=args.dropout,
    )
    model = gpt_model.GPT(cfg, seed=args.seed).to(ctx.device)
    optimizer = build_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    train_dl = make_loader(
        gpt_data.WindowDataset(train_tokens, args.seq_len), args.batch_size, True, ctx
    )
    val_dl = make_loader(
        gpt_data.WindowDataset(val_tokens, args.seq_len), args.batch_size, False, ctx
    )
    engine, train_dl, val_dl, scheduler = gt.initialize(
        model, optimizer, gpt_model.GPTLoss(), train_dl, val_dl, scheduler
    )
    if rank0:
        print(
            f"{ctx!r}\nGPT {args.preset}: {cfg.num_params() / 1e6:.2f}M parameters, "
            f"{len(train_tokens) / 1e3:.0f}k train / {len(val_tokens) / 1e3:.0f}k held-out bytes, "
            f"global batch {args.batch_size} x {args.seq_len} tokens",
            flush=True,
        )

    tokens_per_step = args.batch_size * args.seq_len
    losses: list[float] = []
    first = resume(args, engine, scheduler, losses, ctx)
    bar = tqdm(total=args.steps, initial=first, disable=not rank0, dynamic_ncols=True)
    batches = forever(train_dl)
    for _ in range(first):  # the data position: the same batches as an uninterrupted run
        next(batches)
    engine.train()
    start = tick = time.perf_counter()
    for step in range(first, args.steps):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(
            batches, forward_only=False, return_loss=True, return_output_label=False
        )
        engine.step()  # also steps the LR scheduler
        losses.append(mean_loss(loss, ctx))
        now = time.perf_counter()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / (now - tick):,.0f}")
        bar.update()
        tick = now
        done = step + 1
        if args.checkpoint and args.save_every and done % args.save_every == 0:
            gt.save_checkpoint(
                Path(args.checkpoint) / f"step_{done:06d}", done, engine.model, engine.optimizer,
                scheduler, sharded=True, extra=dict(step=done, losses=list(losses)),
            )  # fmt: skip
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if (
            done == args.crash_at_step
            and restarts == "0"
            and ctx.global_rank == ctx.world_size() - 1
        ):
            print(
                f"rank {ctx.global_rank}: crashing after step {done} (--crash-at-step)", flush=True
            )
            os._exit(1)
    bar.close()
    elapsed = time.perf_counter() - start

    held_out = evaluate(engine, val_dl, args.eval_batches, ctx)
    dense = gpt_model.dense_copy(engine.model, cfg, ctx.device)  # collective
    digest = weights_digest(dense)
    result = dict(losses=losses, held_out=held_out, seconds=elapsed, weights=digest)
    if rank0:
        print(f"weights sha256 {digest}")
        print(
            f"trained {args.steps} steps in {elapsed:.1f} s "
            f"({args.steps * tokens_per_step / elapsed:,.0f} tokens/s)\n"
            f"train loss by step: {curve(losses)}\n"
            f"train loss: first {losses[0]:.3f}, last {losses[-1]:.3f}; "
            f"held-out loss {held_out:.3f} (uniform guess {math.log(cfg.vocab_size):.3f})"
        )
        gen = torch.Generator(device=ctx.device).manual_seed(args.seed)
        prompt = gpt_data.encode(args.prompt).to(ctx.device)[None]
        out = gpt_model.generate(dense, prompt, args.sample_tokens, 0.8, 20, gen)
        print("---- sample ----\n" + gpt_data.decode(out[0].tolist()) + "\n----------------")
        if args.plot:
            plot(losses, held_out, args.plot)
    gt.destroy()
    return result


def resume(args, engine, scheduler, losses: list[float], ctx) -> int:
    """Load ``--resume`` (``auto``: the newest complete checkpoint); returns the next step."""
    if not args.resume or args.resume == "none":
        return 0
    if args.resume == "auto":
        path = gt.latest_checkpoint(args.checkpoint) if args.checkpoint else None
        if path is None:
            return 0  # nothing saved yet: a fresh start
    else:
        path = args.resume
    extra: dict = {}
    gt.load_checkpoint(path, engine.model, engine.optimizer, scheduler, extra=extra)
    losses.extend(extra.get("losses", []))
    if ctx.global_rank == 0:
        print(f"resumed from {path} at step {extra['step']}", flush=True)
    return extra["step"]


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every weight's bytes, in state-dict order (bit-identity between runs)."""
    h = hashlib.sha256()
    for key, t in model.state_dict().items():
        h.update(key.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def curve(losses: list[float], points: int = 6) -> str:
    """``step: mean loss of the 10 steps up to it`` at evenly spaced steps."""
    steps = sorted({max(1, round(i * len(losses) / (points - 1))) for i in range(points)})
    return ", ".join(
        f"{s}: {sum(losses[max(0, s - 10) : s]) / len(losses[max(0, s - 10) : s]):.3f}"
        for s in steps
    )


def plot(losses: list[float], held_out: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, label="train")
    ax.axhline(held_out, color="tab:orange", linestyle="--", label=f"held-out {held_out:.3f}")
    ax.set(xlabel="step", ylabel="cross entropy (nats/byte)", title="GPT on gridtrain")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"loss curve saved to {path}")


if __name__ == "__main__":
    main()
