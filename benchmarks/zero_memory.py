"""ZeRO memory and speed: what a rank holds at each stage against the ZeRO paper, and on a GPU
the largest GPT Gemini (stage 3 + offload) trains against plain PyTorch.

    python benchmarks/zero_memory.py                        # CPU/gloo table, dp 1/2/4/8
    python benchmarks/zero_memory.py --quick                # CI size, dp 1/2/4
    python benchmarks/zero_memory.py throughput             # GPU: tokens/s of stages 1-2 vs plain
    python benchmarks/zero_memory.py largest --mode plain   # GPU: largest GPT at 8 x 1024, plain
    python benchmarks/zero_memory.py largest --mode gemini  # ... with zero=dict(stage=3, offload=True)

**Memory** (default). A GPT (``demos/gpt/model.py``) trains two steps under naive fp16
(fp16 model, fp32 masters, AdamW: the paper's mixed-precision Adam, K = 12) on N gloo
processes, one per data-parallel rank, for N in 1/2/4/8 and each stage (0 = no ZeRO).
Just before the second optimizer step (moments allocated, gradients reduced and
unscaled) every rank sums the bytes of its tensors (``parallel.zero.memory``): the
model's parameters, its gradients, and the optimizer's own (masters, their gradients,
AdamW's moments); the table shows the largest rank. The paper's totals, for Psi
parameters: stage 0 (2+2+K)Psi, stage 1 2Psi+2Psi+K Psi/N, stage 2 2Psi+(2+K)Psi/N,
stage 3 (2+2+K)Psi/N. ``grads`` includes the fp32 gradient the optimizer steps with
(stages 0-2: 4Psi and 4Psi/N beyond the paper, which counts it as transient; stage 3
reduces straight into fp32 and keeps only fp32 parameter shards, which are the masters).

**GPU** (``throughput``, ``largest``). ``throughput``: GPT-2 124M at batch 8 x 1024 bf16,
the plain loop (autocast, fused AdamW; DDP over ``--world`` GPUs) against the engine with
``zero=1`` and ``zero=2``, each in fresh processes, best of ``--rounds``. ``largest``:
GPT sizes from 350M up, each probed in a fresh process (three steps at batch 8 x 1024,
bf16), stopping at the first that fails (out of GPU or CPU memory, or ``--probe-timeout``);
``plain`` is the loop above, ``gemini`` the engine with ``zero=dict(stage=3,
offload=True)`` (parameters, gradients and AdamW in CPU memory, one block on the GPU at
a time). ``--device cpu`` runs either on tiny sizes to check the code paths.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
from benchmarks.rank_procs import rank_context  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402
from gridtrain.amp import AMP_TYPE  # noqa: E402
from gridtrain.parallel import comm  # noqa: E402

K = 12  # bytes of optimizer state per parameter, mixed-precision Adam (the paper's K)
MB = 2**20
CPU_PRESET = dict(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=4096)
QUICK_PRESET = dict(n_layer=2, n_head=4, n_embd=64, block_size=16, vocab_size=512)
# name: (layers, width, heads); GPT-2 / GPT-3 family shapes, vocab 50304
SIZES = {
    "350M": (24, 1024, 16),
    "760M": (24, 1536, 16),
    "1.3B": (24, 2048, 16),
    "2.7B": (32, 2560, 32),
    "4B": (36, 3072, 32),
    "6.7B": (32, 4096, 32),
    "8B": (40, 4096, 32),
    "13B": (40, 5120, 40),
    "20B": (44, 6144, 48),
}
CPU_SIZES = {"tiny": (2, 64, 4), "small": (4, 128, 4)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fp32_grad_extra(stage: int, psi: int, n: int) -> float:
    """What we hold beyond the paper: the fp32 gradient the optimizer steps with (the paper
    counts that copy as transient). Stage 3 reduces into fp32 and keeps fp32 shards only."""
    return {0: 4 * psi, 1: 4 * psi / n, 2: 2 * psi / n, 3: 0.0}[stage]


def paper_bytes(stage: int, psi: int, n: int) -> float:
    """The ZeRO paper's bytes per rank for mixed-precision Adam."""
    return {
        0: (2 + 2 + K) * psi,
        1: 2 * psi + 2 * psi + K * psi / n,
        2: 2 * psi + (2 + K) * psi / n,
        3: (2 + 2 + K) * psi / n,
    }[stage]


# ---- memory (CPU, gloo) ----------------------------------------------------------------------
def _memory_rank(rank, world, port, stage, preset, batch, queue):
    from gridtrain.parallel.zero.memory import memory_report

    torch.set_num_threads(1)
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2.0**8))
    if stage:
        config["zero"] = dict(stage=stage)
    ctx = gt.launch(config, rank, world, "127.0.0.1", port, backend="gloo")
    cfg = gpt_model.GPTConfig(**preset)
    model = gpt_model.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = gt.initialize(model, opt, gpt_model.GPTLoss())
    seen: list[dict] = []
    inner = getattr(engine.optimizer, "optim", engine.optimizer)
    inner.register_step_pre_hook(lambda *_: seen.append(memory_report(engine.model, inner)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        engine.zero_grad()
        engine.execute_schedule(iter([(ids[:, :-1], ids[:, 1:])]), return_output_label=False)
        engine.step()
    rows = comm.all_gather_object(seen[-1], ctx.group(gt.ParallelMode.GLOBAL))
    if rank == 0:
        worst = max(rows, key=lambda r: r["total"])
        queue.put(dict(worst, psi=cfg.num_params(), n=world, stage=stage))
    gt.destroy()


def memory_table(ranks: list[int], preset: dict, batch: int) -> list[dict]:
    rows = []
    spawn = rank_context()
    for n in ranks:
        for stage in (0, 1, 2, 3):
            queue = spawn.SimpleQueue()
            mp.start_processes(
                _memory_rank,
                args=(n, free_port(), stage, preset, batch, queue),
                nprocs=n,
                start_method=spawn.get_start_method(),
            )
            rows.append(queue.get())
    return rows


def print_memory(rows: list[dict]) -> None:
    psi = rows[0]["psi"]
    print(f"\nper-rank bytes, naive fp16 + AdamW, Psi = {psi / 1e6:.2f}M parameters (MB)")
    print("| N | stage | params | grads | optimizer | total | paper | total / paper |"
          " paper + fp32 grad | total / that |")  # fmt: skip
    print("|" + "---|" * 10)
    for r in rows:
        paper = paper_bytes(r["stage"], psi, r["n"])
        expected = paper + fp32_grad_extra(r["stage"], psi, r["n"])
        optimizer = r["masters"] + r["optimizer_state"]
        print(
            f"| {r['n']} | {r['stage']} | {r['parameters'] / MB:.2f} | {r['gradients'] / MB:.2f}"
            f" | {optimizer / MB:.2f} | {r['total'] / MB:.2f} | {paper / MB:.2f}"
            f" | {r['total'] / paper:.3f} | {expected / MB:.2f} | {r['total'] / expected:.3f} |"
        )


# ---- GPU: throughput and the largest model -----------------------------------------------------
def gpt_config(layers: int, width: int, heads: int, seq: int, vocab: int) -> gpt_model.GPTConfig:
    return gpt_model.GPTConfig(
        n_layer=layers, n_head=heads, n_embd=width, block_size=seq, vocab_size=vocab
    )


def build_gpt(cfg: gpt_model.GPTConfig) -> torch.nn.Module:
    """A GPT in CPU memory, filled quickly (GPT-2's init draws every weight one by one, which
    takes minutes at billions of parameters; speed does not depend on the values)."""
    from offload import build  # noqa: PLC0415 - the benchmarks' one fast builder

    return build(cfg, "cpu")


def _adamw(model, device: str):
    fused = device == "cuda" and all(p.device.type == "cuda" for p in model.parameters())
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)


class PlainLoop:
    """The loop a user writes: autocast bf16, loss.backward(), fused AdamW (DDP on N GPUs)."""

    def __init__(self, cfg, ctx):
        self.device = ctx.device
        model = build_gpt(cfg).to(self.device)
        self.opt = _adamw(model, self.device.type)
        if ctx.data_parallel_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.device.type == "cuda" else None
            )
        self.model, self.loss = model, gpt_model.GPTLoss()

    def step(self, x, y) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class EngineLoop:
    """The same model through ``gt.initialize`` (the context's config: zero, bf16)."""

    def __init__(self, cfg, ctx):
        model = build_gpt(cfg)
        zero = ctx.config.zero
        if zero is None or not zero.offload:  # on the device first: fused AdamW, as plain
            model = model.to(ctx.device)
        opt = _adamw(model, ctx.device.type)
        self.engine, *_ = gt.initialize(model, opt, gpt_model.GPTLoss())

    def step(self, x, y) -> None:
        self.engine.zero_grad()
        self.engine.execute_schedule(iter([(x, y)]), return_output_label=False)
        self.engine.step()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(loop, batches, steps: int, warmup: int, device) -> float:
    for i in range(warmup):
        loop.step(*batches[i % len(batches)])
    _sync(device)
    start = time.perf_counter()
    for i in range(steps):
        loop.step(*batches[i % len(batches)])
    _sync(device)
    x = batches[0][0]
    return steps * x.numel() / (time.perf_counter() - start)


def _run_rank(rank, world, port, mode, size, args, queue):
    """One process of one measurement: ``mode`` is plain, zero1, zero2 or gemini."""
    config = dict(fp16=dict(mode=AMP_TYPE.BF16))
    if mode.startswith("zero"):
        config["zero"] = dict(stage=int(mode[-1]))
    elif mode == "gemini":
        config["zero"] = dict(stage=3, offload=True)
    backend = "gloo" if args.device == "cpu" else None
    if args.device == "cpu":  # one thread a process, as torchrun gives each rank: threads
        torch.set_num_threads(1)  # spinning on cores shared with other processes cost time
    ctx = gt.launch(config, rank, world, "127.0.0.1", port, backend=backend, local_rank=rank)
    cfg = gpt_config(*size, seq=args.seq_len, vocab=args.vocab)
    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        ids = ids.to(ctx.device)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    loop = (PlainLoop if mode == "plain" else EngineLoop)(cfg, ctx)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tok_s = max(
        _timed(loop, batches, args.steps, args.warmup, ctx.device) for _ in range(args.rounds)
    )
    peak = torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None
    if rank == 0:
        queue.put(dict(mode=mode, tok_s=tok_s * world, gpu_gib=peak, params=cfg.num_params()))
    gt.destroy()


def measure(mode: str, size, args) -> dict:
    spawn = rank_context()
    queue = spawn.SimpleQueue()
    mp.start_processes(
        _run_rank,
        args=(args.world, free_port(), mode, size, args, queue),
        nprocs=args.world,
        start_method=spawn.get_start_method(),
    )
    return queue.get()


def throughput(args) -> None:
    size = (12, 768, 12) if args.device == "cuda" else CPU_SIZES["small"]
    modes, best = ("plain", "zero1", "zero2"), {}
    for i in range(args.passes):  # whole passes in alternating order: clock drift hits all
        for mode in modes if i % 2 == 0 else modes[::-1]:
            row = measure(mode, size, args)
            if mode not in best or row["tok_s"] > best[mode]["tok_s"]:
                best[mode] = row
    rows = [best[m] for m in modes]
    plain = rows[0]["tok_s"]
    print(f"\nGPT {rows[0]['params'] / 1e6:.0f}M, batch {args.batch_size} x {args.seq_len} "
          f"per rank, {args.world} rank(s), bf16 (tokens/s, all ranks)")  # fmt: skip
    print("| mode | tokens/s | vs plain | peak GPU GiB |")
    print("|---|---|---|---|")
    for r in rows:
        gib = f"{r['gpu_gib']:.1f}" if r["gpu_gib"] is not None else "-"
        print(f"| {r['mode']} | {r['tok_s']:.0f} | {r['tok_s'] / plain:.3f} | {gib} |")


def largest(args) -> None:
    """Probe sizes in increasing order, each in a fresh process; stop at the first failure."""
    sizes = CPU_SIZES if args.device == "cpu" else SIZES
    names = args.sizes.split(",") if args.sizes else list(sizes)
    print(f"\nlargest GPT at batch {args.batch_size} x {args.seq_len}, mode {args.mode}")
    print("| size | parameters | result | tokens/s | peak GPU GiB |")
    print("|---|---|---|---|---|")
    for name in names:
        cmd = [sys.executable, __file__, "probe", "--mode", args.mode, "--sizes", name]
        cmd += ["--device", args.device, "--seq-len", str(args.seq_len)]
        cmd += ["--batch-size", str(args.batch_size), "--vocab", str(args.vocab)]
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.probe_timeout, check=False
            )
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
            row = json.loads(lines[-1][6:]) if lines else None
            why = "ok" if row else _failure(out)
        except subprocess.TimeoutExpired:
            row, why = None, f"timeout {args.probe_timeout}s"
        layers, width, heads = sizes[name]
        params = gpt_config(layers, width, heads, args.seq_len, args.vocab).num_params()
        if row is None:
            print(f"| {name} | {params / 1e6:,.0f}M | {why} | - | - |")
            break
        gib = f"{row['gpu_gib']:.1f}" if row["gpu_gib"] is not None else "-"
        print(f"| {name} | {params / 1e6:,.0f}M | trains | {row['tok_s']:.0f} | {gib} |")


def _failure(out: subprocess.CompletedProcess) -> str:
    text = out.stderr + out.stdout
    if "OutOfMemoryError" in text or "out of memory" in text:
        return "out of GPU memory"
    if out.returncode in (-9, 137):
        return "killed (CPU memory)"
    last = [ln for ln in text.splitlines() if "Error" in ln]
    return (last[-1][:80] if last else f"exit {out.returncode}").replace("|", "/")


def probe(args) -> None:
    sizes = CPU_SIZES if args.device == "cpu" else SIZES
    args.world, args.rounds, args.steps, args.warmup = 1, 1, 2, 1
    row = measure(args.mode, sizes[args.sizes], args)
    print("PROBE " + json.dumps(row), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "what", nargs="?", default="memory", choices=["memory", "throughput", "largest", "probe"]
    )  # noqa: E501
    p.add_argument("--quick", action="store_true", help="memory: small model, dp 1/2/4")
    p.add_argument("--ranks", default=None, help="memory: data-parallel sizes (default 1,2,4,8)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--mode", default="gemini", choices=["plain", "gemini"], help="largest")
    p.add_argument("--sizes", default=None, help="largest: comma list of SIZES names")
    p.add_argument("--world", type=int, default=1, help="throughput: GPUs (data parallel)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu 64)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10, help="throughput: timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--passes", type=int, default=None, help="throughput: passes over the modes (cuda 2)"
    )
    p.add_argument("--probe-timeout", type=int, default=240, help="largest: seconds per size")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.what != "memory":
        args.vocab = min(args.vocab, 512)
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)
        args.rounds = min(args.rounds, 1)
    args.seq_len = args.seq_len or (1024 if args.device == "cuda" else 64)
    args.passes = args.passes or (2 if args.device == "cuda" else 1)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.what == "throughput":
        return throughput(args)
    if args.what == "largest":
        return largest(args)
    if args.what == "probe":
        return probe(args)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    ranks = ranks or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    preset = QUICK_PRESET if args.quick else CPU_PRESET
    rows = memory_table(ranks, preset, batch=8)
    print_memory(rows)
    assert all(math.isfinite(r["total"]) for r in rows)


if __name__ == "__main__":
    main()
