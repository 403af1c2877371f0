"""Hugging Face GPT-2 and a Llama-shaped HF model through gridtrain's default config against
the same HF model in a plain bf16 loop, eager and compiled.

    python benchmarks/hf_throughput.py                  # GPU: GPT-2 124M and Llama 134M, seq 1024
    python benchmarks/hf_throughput.py --device cpu     # CI: tiny GPT-2, seq 64, fp32 (~30 s)

Each model is built from its config class (no download): ``GPT2LMHeadModel`` from
``GPT2Config()`` (the 124M GPT-2 shape: 12 layers, 768 wide, 50257 tokens) and
``LlamaForCausalLM`` at the same depth and width (12 heads, SwiGLU 2048, RMSNorm, rotary,
32000 tokens, untied head: 134M), both with SDPA attention, trained on random token ids.
The rows run in the same process, alternating for ``--rounds`` rounds; each keeps its best
round, so clock drift hits all alike:

* ``plain eager``: what a user writes without gridtrain: ``torch.autocast(bf16)``,
  ``F.cross_entropy(out.logits...)``, ``loss.backward()``, fused AdamW on fp32 weights;
  ``plain compiled``: the same with ``torch.compile(model)``;
* ``engine``: ``gt.initialize(model, optimizer, gt.nn.CrossEntropyLoss())`` with
  ``fp16 = dict(mode=AMP_TYPE.BF16)`` and no speed key (the device's defaults: on CUDA the
  decoder layers and the loss compiled, cuDNN attention first on Hopper, fused AdamW), then
  the plain HF loop through the engine: ``out = engine(input_ids)``,
  ``engine.criterion(out.logits.reshape(-1, V), labels)``, ``engine.backward(loss)``,
  ``engine.step()``.

The targets on one H200: engine >= 2x plain eager and >= 1.1x plain compiled. MFU uses
6·N + 12·L·H·S FLOPs per token (N: the parameters without GPT-2's position table; PaLM
appendix B) and the dense bf16 peak (989 TFLOP/s H100/H200 SXM; ``--peak-tflops``
overrides it).
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
    p.add_argument("--models", default=None, help="comma list of gpt2,llama (cpu: gpt2)")
    p.add_argument(
        "--plain", default=None, help="plain rows: eager,compiled (default both; cpu eager)"
    )
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
    args.models = (args.models or ("gpt2,llama" if cuda else "gpt2")).split(",")
    args.plain = (args.plain or ("eager,compiled" if cuda else "eager")).split(",")
    if set(args.models) - set(MODELS) or set(args.plain) - {"eager", "compiled"}:
        raise SystemExit(f"--models: {', '.join(MODELS)}; --plain: eager,compiled")
    return args


def gpt2_config(args):
    """GPT-2 124M on the GPU; the issue's tiny test shape on the CPU (no dropout in either,
    so every loop does the same work)."""
    from transformers import GPT2Config

    drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if args.device == "cuda":
        return GPT2Config(n_positions=max(1024, args.seq_len), **drop)
    return GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=args.seq_len,
        bos_token_id=0, eos_token_id=0, **drop,
    )  # fmt: skip


def llama_config(args):
    """A Llama at GPT-2 124M's depth and width (134M with its 32000-token untied head); a
    tiny one on the CPU."""
    from transformers import LlamaConfig

    big = args.device == "cuda"
    return LlamaConfig(
        vocab_size=32000 if big else 256, hidden_size=768 if big else 64,
        intermediate_size=2048 if big else 128, num_hidden_layers=12 if big else 2,
        num_attention_heads=12 if big else 4, num_key_value_heads=12 if big else 4,
        max_position_embeddings=max(1024, args.seq_len), bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


MODELS = {"gpt2": gpt2_config, "llama": llama_config}


def build_model(cfg, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(device).train()


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
    """The same HF model in the loop everyone writes: autocast, backward, fused AdamW;
    ``compiled``: ``torch.compile(model)``."""

    def __init__(self, cfg, args, device, compiled: bool):
        model = build_model(cfg, device)
        self.model = torch.compile(model) if compiled else model
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
    """The HF model through ``gt.initialize`` (the launch's config: no speed key, so the
    device's defaults): the plain HF loop written against the engine."""

    def __init__(self, cfg, args, device):
        model = build_model(cfg, device)
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


def flops_per_token(model, seq_len: int) -> float:
    """6·N + 12·L·H·S, N without a position table (GPT-2's ``wpe``)."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


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


def first_step_s(loop, batch, device: str) -> float:
    """Seconds of ``loop``'s first step: with compilation, mostly compiling."""
    sync(device)
    start = time.perf_counter()
    loop.step(batch)
    sync(device)
    return time.perf_counter() - start


def measure(name: str, args) -> dict:
    """Best-of-rounds tokens/s and the first step's seconds of every row, for one model."""
    cfg = MODELS[name](args)
    batches = make_batches(cfg, args, args.device)
    loops = {
        f"plain {how}": PlainLoop(cfg, args, args.device, how == "compiled") for how in args.plain
    }
    loops["engine"] = EngineLoop(cfg, args, args.device)
    first = {row: first_step_s(loop, batches[0], args.device) for row, loop in loops.items()}
    best = dict.fromkeys(loops, 0.0)
    for _ in range(args.rounds):
        for row, loop in loops.items():
            best[row] = max(best[row], timed_round(loop, batches, args))
    model = loops["engine"].engine.model
    out = dict(
        model=type(model).__name__,
        params_m=sum(p.numel() for p in model.parameters()) / 1e6,
        flops=flops_per_token(model, args.seq_len),
        best=best,
        first=first,
    )
    del loops
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def print_table(results: list[dict], args) -> None:
    peak, note = peak_flops(args)
    print(
        f"\nHF models: seq {args.seq_len}, batch {args.batch_size}, {args.dtype}, "
        f"{args.device}; engine: the default config (no speed key); best of {args.rounds} "
        f"rounds x {args.steps} steps; MFU peak: {note}"
    )
    ratios = "".join(f" {'vs ' + how:>12}" for how in args.plain)
    head = (
        f"{'model':<18} {'params':>8} {'loop':<15} {'tokens/s':>12} {'MFU':>7} "
        f"{'1st step s':>10}{ratios}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        for row, tok_s in r["best"].items():
            mfu = f"{100 * tok_s * r['flops'] / peak:.1f}%" if peak else "-"
            cells = "".join(
                f" {tok_s / r['best'][f'plain {how}']:>12.3f}" if row == "engine" else " " * 13
                for how in args.plain
            )
            print(
                f"{r['model']:<18} {r['params_m']:>7.1f}M {row:<15} {tok_s:>12,.0f} {mfu:>7} "
                f"{r['first'][row]:>10.1f}{cells}"
            )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    config = {} if args.dtype == "fp32" else dict(fp16=dict(mode=AMP_TYPE.BF16))
    backend = "gloo" if args.device == "cpu" else None
    gt.launch(config, 0, 1, "127.0.0.1", free_port(), backend=backend)
    try:
        results = [measure(name, args) for name in args.models]
    finally:
        gt.destroy()
    print_table(results, args)
    return results


if __name__ == "__main__":
    main()
