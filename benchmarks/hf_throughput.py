"""Hugging Face GPT-2 through gridtrain's engine against the same HF model in a plain bf16 loop.

    python benchmarks/hf_throughput.py                  # GPU: GPT-2 124M, seq 1024, batch 16, bf16
    python benchmarks/hf_throughput.py --device cpu     # CI: tiny GPT-2, seq 64, fp32 (~30 s)

Both rows train ``transformers.GPT2LMHeadModel`` built from ``GPT2Config()`` (the 124M
GPT-2 shape: 12 layers, 768 wide, 50257 tokens; no download) with SDPA attention on
random token ids, in the same process, alternating for ``--rounds`` rounds; each keeps
its best round, so clock drift hits both alike:

* ``plain``: what a user writes without gridtrain: ``torch.autocast(bf16)``,
  ``F.cross_entropy(out.logits...)``, ``loss.backward()``, fused AdamW on fp32 weights;
* ``engine``: ``gt.initialize(model, optimizer, gt.nn.CrossEntropyLoss())`` with
  ``fp16 = dict(mode=AMP_TYPE.BF16)``, then the plain HF loop through the engine:
  ``out = engine(input_ids)``, ``engine.criterion(out.logits.reshape(-1, V), labels)``,
  ``engine.backward(loss)``, ``engine.step()``.

The issue's bar: engine / plain >= 0.97 on one H200. MFU uses 6·N + 12·L·H·S FLOPs per
token (N without the position table; PaLM appendix B) and the dense bf16 peak
(989 TFLOP/s H100/H200 SXM; ``--peak-tflops`` overrides it).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
from gridtrain.amp import AMP_TYPE  # noqa: E402

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense bf16, SXM


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu 64)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences/step (16; cpu 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (20; cpu 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per round (3; cpu 1)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (3; cpu 2)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="bf16 (cpu fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in both")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the stated peak")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    args.device = "cuda" if cuda else "cpu"
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.steps = args.steps or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.rounds = args.rounds or (3 if cuda else 2)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


def model_config(args):
    """GPT-2 124M on the GPU; the issue's tiny test shape on the CPU (no dropout in either,
    so both loops do the same work)."""
    from transformers import GPT2Config

    drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if args.device == "cuda":
        return GPT2Config(n_positions=max(1024, args.seq_len), **drop)
    return GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=args.seq_len,
        bos_token_id=0, eos_token_id=0, **drop,
    )  # fmt: skip


def build_model(cfg, device):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).to(device).train()


def adamw(model, device):
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )


def make_batches(cfg, args, device, n: int = 4):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


class PlainLoop:
    """The same HF model in the loop everyone writes: autocast, backward, fused AdamW."""

    def __init__(self, cfg, args, device):
        model = build_model(cfg, device)
        self.model = torch.compile(model) if args.compile else model
        self.opt = adamw(model, device)
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else None
        self.device = device

    def step(self, batch) -> None:
        x, y = batch
        amp = torch.autocast(self.device, dtype=self.dtype) if self.dtype else None
        with amp or contextlib.nullcontext():
            logits = self.model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class EngineLoop:
    """The HF model through ``gt.initialize``: the plain HF loop written against the engine."""

    def __init__(self, cfg, args, device):
        model = build_model(cfg, device)
        if args.compile:
            model = torch.compile(model)
        self.engine, *_ = gt.initialize(model, adamw(model, device), gt.nn.CrossEntropyLoss())
        self.engine.train()

    def step(self, batch) -> None:
        x, y = batch
        engine = self.engine
        engine.zero_grad()
        logits = engine(input_ids=x).logits
        loss = engine.criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_round(loop, batches, args) -> float:
    """Tokens per second over ``args.steps`` steps after ``args.warmup`` untimed ones."""
    for i in range(args.warmup):
        loop.step(batches[i % len(batches)])
    sync(args.device)
    start = time.perf_counter()
    for i in range(args.steps):
        loop.step(batches[i % len(batches)])
    sync(args.device)
    return args.steps * args.batch_size * args.seq_len / (time.perf_counter() - start)


def flops_per_token(cfg, seq_len: int) -> float:
    h, layers = cfg.n_embd, cfg.n_layer
    inner = cfg.n_inner or 4 * h
    n = cfg.vocab_size * h + layers * (4 * h * h + 2 * h * inner + 9 * h + inner) + 2 * h
    return 6 * n + 12 * layers * h * seq_len


def peak_flops(args) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"{args.peak_tflops:g} TFLOP/s (given)"
    if args.device == "cuda" and args.dtype == "bf16":
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s dense bf16 ({name})"
        return None, f"unknown for {name}: pass --peak-tflops"
    return None, "no peak for this device/dtype"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    config = {} if args.dtype == "fp32" else dict(fp16=dict(mode=AMP_TYPE.BF16))
    backend = "gloo" if args.device == "cpu" else None
    gt.launch(config, 0, 1, "127.0.0.1", free_port(), backend=backend)
    try:
        cfg = model_config(args)
        batches = make_batches(cfg, args, args.device)
        plain, engine = PlainLoop(cfg, args, args.device), EngineLoop(cfg, args, args.device)
        best = {"plain": 0.0, "engine": 0.0}
        for _ in range(args.rounds):
            best["plain"] = max(best["plain"], timed_round(plain, batches, args))
            best["engine"] = max(best["engine"], timed_round(engine, batches, args))
    finally:
        gt.destroy()
    peak, note = peak_flops(args)
    flops = flops_per_token(cfg, args.seq_len)
    params = sum(p.numel() for p in plain.model.parameters()) / 1e6
    result = dict(best, ratio=best["engine"] / best["plain"], params_m=params)
    print(
        f"\nHF GPT2LMHeadModel ({params:.1f}M parameters): seq {args.seq_len}, batch "
        f"{args.batch_size}, {args.dtype}, {args.device}{' compiled' if args.compile else ''}; "
        f"best of {args.rounds} rounds x {args.steps} steps; MFU peak: {note}"
    )
    head = f"{'loop':<8} {'tokens/s':>12} {'MFU':>7} {'engine/plain':>13}"
    print(head + "\n" + "-" * len(head))
    for mode in ("plain", "engine"):
        mfu = f"{100 * best[mode] * flops / peak:.1f}%" if peak else "-"
        ratio = f"{result['ratio']:.3f}" if mode == "engine" else ""
        print(f"{mode:<8} {best[mode]:>12,.0f} {mfu:>7} {ratio:>13}")
    return result


if __name__ == "__main__":
    main()
