"""Fine-tune a Hugging Face GPT-2 or Llama with gridtrain; the config file picks the layout.

    gridtrain run --nproc_per_node 2 --config demos/hf_finetune/configs/dp.py \\
        demos/hf_finetune/finetune.py --model_type gpt2 --pretrained_path /tmp/hf_gpt2 \\
        --target_f1 0.9

After Colossal-AI's GPT ``finetune.py`` (``--model_type``, ``--pretrained_path``,
``--target_f1``), with the HF model left as it is. ``--pretrained_path`` is a local
Hugging Face directory (``config.json`` + ``*.safetensors``, from ``save_pretrained`` of
``transformers`` or of ``gridtrain.hf``). With no network there is nothing to download, so
when the directory holds no weights yet the script first pre-trains the tiny model on
offline text (next-byte prediction on Python's help topics, ``data.py``) under the same
layout and saves it there with ``gridtrain.hf.save_pretrained``. Then it fine-tunes:

* the model is built on the meta device (``gt.lazy_init()``), ``gt.initialize`` allocates
  this rank's shards, ``gridtrain.hf.load_pretrained`` reads only this rank's slices;
* the task (``data.py``): tag every word of a help-text window as inside an indented
  block (code, grammar rules, tables: "C") or prose ("P"), with the LM's own head;
* the training loop is the plain HF loop (``out = engine(input_ids=..., attention_mask=...)``,
  ``engine.criterion(out, labels)``), or ``engine.execute_schedule`` with dict batches
  under a pipeline;
* the fine-tuned model is saved with ``gridtrain.hf.save_pretrained`` (every rank writes
  its part) and scored by plain ``transformers`` loading that directory: accuracy over
  tagged words and F1 of the "C" spans on held-out text (the held-out loss is computed in
  the run's layout too). The run fails (exit status 1) when ``--target_acc`` or
  ``--target_f1`` is not reached.

Command-line arguments override the config's UPPER_CASE constants, which override the
defaults. ``--batch_size`` is the global batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import gridtrain as gt  # noqa: E402
import gridtrain.hf as gthf  # noqa: E402
from demos.config_args import config_parser, fill_from_config  # noqa: E402
from demos.hf_finetune import data  # noqa: E402
from gridtrain.parallel import comm  # noqa: E402

PM = gt.ParallelMode

# (argument, config constant, type, default, help)
ARGS = [
    ("model_type", "MODEL_TYPE", str, "gpt2", "gpt2 or llama"),
    ("pretrained_path", "PRETRAINED_PATH", str, None, "local HF directory (made if empty)"),
    ("target_acc", "TARGET_ACC", float, None, "fail unless the test accuracy reaches this"),
    ("target_f1", "TARGET_F1", float, None, "fail unless the test F1 of 'C' spans reaches this"),
    ("steps", "FT_STEPS", int, None, "fine-tuning optimizer steps (default: gpt2 300, llama 600)"),
    ("lr", "LR", float, None, "fine-tuning peak learning rate (default: gpt2 1e-3, llama 3e-3)"),
    ("batch_size", "GLOBAL_BATCH_SIZE", int, 16, "sequences per step over all data ranks"),
    ("seq_len", "SEQ_LEN", int, 64, "bytes per sequence"),
    ("pretrain_steps", "PRETRAIN_STEPS", int, 600, "next-byte steps when no weights exist"),
    ("pretrain_lr", "PRETRAIN_LR", float, 3e-3, "pre-training peak learning rate"),
    ("train_size", "TRAIN_SIZE", int, 4096, "fine-tuning examples"),
    ("test_size", "TEST_SIZE", int, 256, "held-out examples scored"),
    ("save_path", "SAVE_PATH", str, None, "fine-tuned HF directory (default PRETRAINED_finetuned)"),
    ("seed", "SEED", int, 0, "weight-init seed of a fresh model"),
]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line alone (before any launch, so ``--help`` needs no config)."""
    return config_parser(__doc__.split("\n")[0], ARGS, sep="_").parse_args(argv)


def with_config(args: argparse.Namespace, config) -> argparse.Namespace:
    """Fill what the command line left unset from the config's constants, then check it."""
    fill_from_config(args, config, ARGS)
    if args.model_type not in ("gpt2", "llama"):
        raise SystemExit(f"--model_type must be gpt2 or llama, got {args.model_type!r}")
    if not args.pretrained_path:
        raise SystemExit("--pretrained_path DIR is required (it is made when empty)")
    # tuned on one process: the tiny Llama (no position table) needs a larger step, longer
    if args.lr is None:
        args.lr = {"gpt2": 1e-3, "llama": 3e-3}[args.model_type]
    if args.steps is None:
        args.steps = {"gpt2": 300, "llama": 600}[args.model_type]
    return args


def tiny_config(model_type: str, seq_len: int):
    """The tiny byte-level models (vocabulary 256): ~0.8M (GPT-2) / ~1.1M (Llama) parameters."""
    import transformers as tf

    if model_type == "gpt2":
        return tf.GPT2Config(
            vocab_size=data.VOCAB_SIZE, n_embd=128, n_layer=4, n_head=4, n_positions=seq_len,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return tf.LlamaConfig(
        vocab_size=data.VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def lm_loss(out, labels):
    """Cross entropy of the HF output's logits, whatever layout they come in; labels are
    shifted already (HF's own shift would cross shards under sequence parallelism)."""
    logits = out.logits
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def loader(dataset, args, ctx, shuffle: bool):
    dp = ctx.data_parallel_size
    if args.batch_size % dp:
        raise SystemExit(f"--batch_size {args.batch_size} is not divisible by data-parallel {dp}")
    return gt.data.get_dataloader(dataset, args.batch_size // dp, shuffle=shuffle, drop_last=True)


def forever(dl):
    epoch = 0
    while True:
        if hasattr(dl.sampler, "set_epoch"):
            dl.sampler.set_epoch(epoch)
        yield from dl
        epoch += 1


def train_step(engine, batch: dict) -> float:
    """One optimizer step; the loss averaged over every rank that computed one."""
    engine.zero_grad()
    if engine.ctx.pipeline_parallel_size > 1:  # stages pass hidden states and the mask on
        _, _, loss = engine.execute_schedule(iter([batch]), return_output_label=False)
    else:  # the plain HF loop
        out = engine(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
        loss = engine.criterion(out, batch["labels"])
        engine.backward(loss)
    engine.step()
    t = torch.tensor([loss.item(), 1.0], device=engine.ctx.device)
    comm.all_reduce_(t, engine.ctx.group(PM.GLOBAL))
    return (t[0] / t[1]).item()


def schedule(optimizer, steps: int, warmup: int = 20):
    """Linear warm-up, then linear decay to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pretrain(args, ctx) -> None:
    """Next-byte pre-training of a fresh tiny model, saved to ``--pretrained_path``."""
    import transformers as tf

    torch.manual_seed(args.seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(args.model_type, args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.1)
    train, _ = data.lm_datasets(args.seq_len)
    dl = loader(train, args, ctx, shuffle=True)
    sched = schedule(opt, args.pretrain_steps)
    engine, dl, _, _ = gt.initialize(model, opt, lm_loss, dl, lr_scheduler=sched)
    engine.train()
    batches = forever(dl)
    for step in range(args.pretrain_steps):
        x, y = next(batches)
        loss = train_step(engine, dict(input_ids=x, labels=y))
        if ctx.global_rank == 0 and (step % 50 == 0 or step == args.pretrain_steps - 1):
            print(f"pre-train step {step}: next-byte loss {loss:.3f}", flush=True)
    gthf.save_pretrained(engine.model, args.pretrained_path)
    if ctx.global_rank == 0:
        print(f"saved the pre-trained model to {args.pretrained_path}", flush=True)


def has_weights(path: str) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


@torch.no_grad()
def held_out_loss(engine, test_dl) -> float:
    """Mean loss on the test windows, computed in the run's layout."""
    engine.eval()
    t = torch.zeros(2, dtype=torch.float64, device=engine.ctx.device)
    for batch in test_dl:
        _, _, loss = engine.execute_schedule(
            iter([batch]), forward_only=True, return_loss=True, return_output_label=False
        )
        if loss is not None:  # pipeline: every stage gets the last stage's loss
            t += torch.tensor([float(loss), 1.0], dtype=torch.float64, device=t.device)
    comm.all_reduce_(t, engine.ctx.group(PM.GLOBAL))
    engine.train()
    return (t[0] / t[1]).item()


@torch.no_grad()
def score(directory: str, test_set) -> dict[str, float]:
    """Accuracy over tagged words and F1 of the "C" spans, by plain ``transformers`` loading
    the directory ``save_pretrained`` wrote: the same scorer for every layout."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(directory).eval()
    tp = fp = fn = tn = 0
    for start in range(0, len(test_set), 64):
        rows = [test_set[i] for i in range(start, min(start + 64, len(test_set)))]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        tagged = batch["labels"] != -100
        pred = logits[tagged][:, data.CODE] > logits[tagged][:, data.PROSE]
        gold = batch["labels"][tagged] == data.CODE
        tp += int((pred & gold).sum())
        fp += int((pred & ~gold).sum())
        fn += int((~pred & gold).sum())
        tn += int((~pred & ~gold).sum())
    words = tp + fp + fn + tn
    return dict(acc=(tp + tn) / max(1, words), f1=2 * tp / max(1, 2 * tp + fp + fn), words=words)


def broadcast_scores(scores: dict | None, ctx) -> dict[str, float]:
    """Rank 0's scores on every rank (every rank must agree on the exit status)."""
    keys = ("acc", "f1", "words")
    t = torch.zeros(len(keys), dtype=torch.float64, device=ctx.device)
    if scores is not None:
        t = torch.tensor([float(scores[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    comm.broadcast_(t, 0, ctx.group(PM.GLOBAL))
    return dict(zip(keys, t.tolist(), strict=True))


def main(argv=None) -> dict:
    args = parse_args(argv)
    ctx = gt.launch_from_torch()
    args = with_config(args, ctx.config)
    rank0 = ctx.global_rank == 0
    if not has_weights(args.pretrained_path):
        pretrain(args, ctx)
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(args.pretrained_path)
    with gt.lazy_init():  # nothing allocated until gt.initialize keeps this rank's shards
        model = tf.AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    train_set, test_set = data.task_datasets(args.seq_len, args.train_size, args.test_size)
    train_dl, test_dl = loader(train_set, args, ctx, True), loader(test_set, args, ctx, False)
    engine, train_dl, test_dl, _ = gt.initialize(
        model, optimizer, lm_loss, train_dl, test_dl, schedule(optimizer, args.steps)
    )
    gthf.load_pretrained(engine.model, args.pretrained_path)  # this rank's slices only
    if rank0:
        print(f"{ctx!r}\n{type(model).__name__} from {args.pretrained_path}", flush=True)
        if engine.plan is not None:
            print(engine.plan, flush=True)
    before = held_out_loss(engine, test_dl)
    engine.train()
    batches, losses = forever(train_dl), []
    start = time.perf_counter()
    for step in range(args.steps):
        losses.append(train_step(engine, next(batches)))
        if rank0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"fine-tune step {step}: loss {losses[-1]:.3f}", flush=True)
    seconds = time.perf_counter() - start
    after = held_out_loss(engine, test_dl)
    save_path = args.save_path or f"{args.pretrained_path.rstrip('/')}_finetuned"
    gthf.save_pretrained(engine.model, save_path)  # every rank writes its part
    scores = broadcast_scores(score(save_path, test_set) if rank0 else None, ctx)
    if rank0:
        print(
            f"fine-tuned {args.steps} steps in {seconds:.0f} s; held-out loss {before:.3f} -> "
            f"{after:.3f}; saved to {save_path}\ntest (transformers loading {save_path}): "
            f"accuracy {scores['acc']:.3f}, F1 {scores['f1']:.3f} over {scores['words']:.0f} "
            f"words of {len(test_set)} held-out windows",
            flush=True,
        )
    failed = [
        f"{name} {scores[key]:.3f} < target {target}"
        for name, key, target in (
            ("accuracy", "acc", args.target_acc),
            ("F1", "f1", args.target_f1),
        )
        if target is not None and not scores[key] >= target
    ]
    gt.destroy()
    if failed:
        if rank0:
            print("FAILED: " + "; ".join(failed), flush=True)
        raise SystemExit(1)
    return dict(scores, losses=losses, seconds=seconds, loss_before=before, loss_after=after)


if __name__ == "__main__":
    main()
