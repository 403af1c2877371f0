"""The largest GPT batch that trains on one GPU: plain PyTorch against the engine with
``chunked_loss`` (the LM head and cross entropy per token chunk, so the ``[tokens, vocab]``
logits, their fp32 copy and their gradient never exist whole), and with
``activation_checkpoint`` added (each block's activations recomputed in the backward).

    python benchmarks/largest_batch.py                       # GPU: GPT-2 350M, seq 1024, bf16
    python benchmarks/largest_batch.py --device cpu --preset tiny --seq-len 64   # CI form

Per mode, peak allocated memory is measured over two training steps at two small
batches; it grows linearly in the batch (``fixed + per_sequence x batch``), which gives
the predicted largest batch in the device's memory (97 %, the rest for the allocator's
fragmentation). The prediction is then checked by training at it, stepping down 5 % on
an out-of-memory error. Both modes train the same model (``demos/gpt/model.py``) with
fused AdamW under bf16 autocast, eager (compiling changes what is saved, alike for both).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpt_throughput as gpt  # noqa: E402

import gridtrain as gt  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402

CHUNKED = dict(chunked_loss=dict(chunk_tokens=8192))
# and every block recomputed in the backward (Megatron's full recompute)
RECOMPUTE = dict(CHUNKED, activation_checkpoint=True)
MODES = {"plain": None, "engine chunked_loss": CHUNKED, "engine + recompute": RECOMPUTE}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--preset", default=None, help="GPT preset (default medium; cpu tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu 64)")
    p.add_argument("--probe", default="4,8", help="two small batches to fit the line through")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory (cpu: 2)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    args.device = "cuda" if cuda else "cpu"
    args.preset = args.preset or ("medium" if cuda else "tiny")
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.probe = [int(b) for b in args.probe.split(",")]
    if args.memory_gb is None:
        args.memory_gb = torch.cuda.mem_get_info()[1] / 2**30 if cuda else 2.0
    # what gpt_throughput's loops read
    args.dtype, args.compile, args.steps, args.warmup = "bf16" if cuda else "fp32", False, 2, 0
    return args


def _peak(mode: str, cfg, args, batch: int) -> float:
    """Peak bytes over two steps at ``batch`` (raises torch.OutOfMemoryError)."""
    args.batch_size = batch
    device = args.device
    loop = None
    try:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        loop = (
            gpt.PlainLoop(cfg, args, device)
            if mode == "plain"
            else (gpt.EngineLoop(cfg, args, device, extra=MODES[mode]))
        )
        for b in gpt.make_batches(cfg, args, device, n=2):
            loop.step(b)
        gpt.sync(device)
        return torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    finally:
        del loop
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def largest(mode: str, cfg, args) -> dict:
    b1, b2 = args.probe
    m1, m2 = _peak(mode, cfg, args, b1), _peak(mode, cfg, args, b2)
    per_seq = (m2 - m1) / (b2 - b1)
    fixed = m1 - per_seq * b1
    row = dict(mode=mode, fixed_gb=fixed / 2**30, per_seq_gb=per_seq / 2**30)
    if args.device != "cuda":  # no allocator statistics: the run itself is the check
        return dict(row, predicted=None, verified=b2)
    batch = int((args.memory_gb * 2**30 * 0.97 - fixed) / per_seq)
    row["predicted"] = batch
    for _ in range(6):
        try:
            _peak(mode, cfg, args, batch)
            return dict(row, verified=batch)
        except torch.OutOfMemoryError:
            batch = int(batch * 0.95)
    return dict(row, verified=None)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cfg = gpt_model.preset(args.preset, block_size=max(args.seq_len, 64))
    gt.launch(gpt.config_for(args), 0, 1, "127.0.0.1", gpt.free_port(),
              backend="gloo" if args.device == "cpu" else None)  # fmt: skip
    rows = [largest(mode, cfg, args) for mode in MODES]
    gt.destroy()
    print(
        f"\nlargest batch: GPT {args.preset} ({cfg.num_params() / 1e6:.0f}M), seq {args.seq_len}, "
        f"{args.dtype}, {args.device}, {args.memory_gb:.0f} GiB"
    )
    head = f"{'mode':<20} {'fixed GiB':>10} {'GiB/seq':>8} {'predicted':>10} {'trained':>8} {'vs plain':>9}"
    print(head + "\n" + "-" * len(head))
    base = rows[0]["verified"]
    for r in rows:
        ratio = f"{r['verified'] / base:.2f}" if r["verified"] and base else "-"
        pred = r["predicted"] if r["predicted"] is not None else "-"
        print(
            f"{r['mode']:<20} {r['fixed_gb']:>10.2f} {r['per_seq_gb']:>8.3f} {pred!s:>10} "
            f"{r['verified']!s:>8} {ratio:>9}"
        )
    return rows


if __name__ == "__main__":
    main()
