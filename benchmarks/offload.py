"""Gemini on one GPU under a memory cap: the largest GPT each setting trains, and how fast.

    python benchmarks/offload.py                    # GPU: the search and the table (24 GiB cap)
    python benchmarks/offload.py --gpu-mem 40       # another cap
    python benchmarks/offload.py --quick            # CPU (CI): parity and bytes moved per step
    python benchmarks/offload.py --peer deepspeed   # + DeepSpeed ZeRO-Offload rows

The GPU's memory is capped with ``torch.cuda.set_per_process_memory_fraction`` (``--gpu-mem``
GiB) and the host state of an offloaded run with ``--host-mem`` GB, checked before anything
is allocated against ``offload_plan`` (the formula ``gridtrain estimate`` uses). Three
settings train GPT (``demos/gpt``, GPT-2 shapes, vocab 50304) at ``--batch`` x ``--seq`` tokens
per micro-step and ``--accumulation`` micro-steps per step, bf16, AdamW, each block
recomputed in the backward:

* ``plain``: the loop a user writes: autocast, ``loss.backward()``, fused AdamW on the GPU,
  ``torch.utils.checkpoint`` per block;
* ``zero3``: ``gt.initialize`` with ``zero=3`` (FSDP2; one GPU, so nothing is sharded);
* ``gemini``: ``gt.initialize`` with ``zero=dict(stage=3, offload=True)``.

Each size runs in a fresh process (``probe``). Each setting searches its ladder, by default
every size of ``SIZES`` (350M to 6.7B; ``--plain`` / ``--zero3`` / ``--gemini`` give another),
by bisection: a size that trains means every smaller one does, one that fails (out of GPU
memory, over the host cap, or killed) that every larger one does, so the largest size that
trains is found in about log2(ladder) probes, and the one above it is shown failing. The
ratios are taken against plain's largest size that trained. The table gives parameters, tokens/s,
model TFLOP/s (``GPTConfig.flops_per_token``: 6N plus attention), peak GPU memory
(allocated), peak host memory (the process's resident set) and the host-to-device and
device-to-host GB per step (counted by the engine), for the largest size of each setting,
for the fixed ``--mid`` size in all three, and for the largest sizes again at
``--accumulation 1``, then the ratios: Gemini's largest over plain's largest (parameters)
and its model FLOP rate over plain's at ``--accumulation`` micro-steps and without
accumulation. ``--quick`` trains a tiny GPT on the CPU through Gemini (the root chunk
resident, the blocks streamed, two micro-steps) and a plain float64 loop, checks that the
losses and weights agree and that the bytes moved per step equal ``offload_plan``'s formula;
then the same in bf16 (gradients sent in bf16, masters uploaded in bf16: half the bytes of
an fp32 link).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402
from gridtrain.parallel.zero.offload_plan import (  # noqa: E402
    AUTO_FRACTION,
    ChunkShape,
    device_param_bytes,
    host_bytes,
    transfer_per_step,
)

GB, GIB = 1e9, 2**30
# name: (layers, width, heads), head size 128 where it divides
SIZES = {
    "tiny": (2, 64, 4),  # the code paths on the CPU (--device cpu)
    "350M": (24, 1024, 16),
    "760M": (24, 1536, 12),
    "880M": (24, 1664, 13),
    "1.0B": (24, 1792, 14),
    "1.2B": (24, 1920, 15),
    "1.3B": (24, 2048, 16),
    "1.4B": (26, 2048, 16),
    "1.5B": (28, 2048, 16),
    "1.7B": (32, 2048, 16),
    "2.7B": (32, 2560, 20),
    "4.2B": (36, 3072, 24),
    "5.1B": (32, 3584, 28),
    "5.7B": (36, 3584, 28),
    "6.1B": (40, 3584, 28),
    "6.7B": (32, 4096, 32),
}
LADDER = ",".join(name for name in SIZES if name != "tiny")  # every setting's default
QUICK = dict(n_layer=3, n_head=4, n_embd=64, block_size=16, vocab_size=128)


def gpt_config(name: str, seq: int, vocab: int) -> gpt_model.GPTConfig:
    layers, width, heads = SIZES[name]
    return gpt_model.GPTConfig(
        n_layer=layers, n_head=heads, n_embd=width, block_size=seq, vocab_size=vocab
    )


@torch.no_grad()
def build(cfg: gpt_model.GPTConfig, device) -> torch.nn.Module:
    """A GPT filled quickly on ``device`` (speed does not depend on the values): tiles of one
    small normal draw for matrices, LayerNorm ones, zero biases."""
    with torch.device("meta"):
        model = gpt_model.GPT(cfg)
    model.to_empty(device=device)
    model.head.classifier.weight = model.embed.tok.weight  # to_empty gives each use its own
    tile = torch.empty(1 << 20, device=device).normal_(0.0, 0.02)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            flat = p.view(-1)
            for start in range(0, flat.numel(), tile.numel()):
                part = flat[start : start + tile.numel()]
                part.copy_(tile[: part.numel()])
    return model


def gemini_plan(cfg: gpt_model.GPTConfig, compute_bytes: int = 2) -> list[ChunkShape]:
    """Gemini's chunks of this GPT on one GPU, all resident (what ``offload_plan`` places
    under the 24 GiB default cap for the ladder's sizes)."""
    h = cfg.n_embd
    block = 12 * h * h + 13 * h
    root = cfg.vocab_size * h + cfg.block_size * h + 2 * h
    return [ChunkShape(n, n, True) for n in [root] + [block] * cfg.n_layer]


# ---- one measurement in this process ------------------------------------------------------
class Plain:
    """Autocast bf16, fused AdamW, ``torch.utils.checkpoint`` around each block."""

    def __init__(self, cfg, device, recompute: bool):
        self.model = build(cfg, device)
        if recompute:
            for block in list(self.model)[1:-1]:
                block.forward = functools.partial(
                    torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False
                )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.loss, self.device = gpt_model.GPTLoss(), device

    def step(self, micro) -> float:
        for x, y in micro:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.loss(self.model(x), y) / len(micro)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item() * len(micro)

    def moved(self) -> dict[str, int]:
        return {"h2d": 0, "d2h": 0}


class Engine:
    """The same model through ``gt.initialize`` (the context's ``zero`` and bf16)."""

    def __init__(self, cfg, ctx, recompute: bool):
        offload = ctx.config.zero is not None and ctx.config.zero.offload
        model = build(cfg, "cpu" if offload else ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not offload)
        self.engine, *_ = gt.initialize(model, opt, gpt_model.GPTLoss())

    def step(self, micro) -> float:
        engine = self.engine
        engine.zero_grad()
        for x, y in micro:
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
        engine.step()
        return loss.item()

    def moved(self) -> dict[str, int]:
        zero = self.engine.zero
        return zero.transfer_bytes() if hasattr(zero, "transfer_bytes") else {"h2d": 0, "d2h": 0}


def config_of(setting: str, recompute: bool, accumulation: int) -> dict:
    config: dict = dict(fp16=dict(mode="bf16"), gradient_accumulation=accumulation)
    if recompute:
        config["activation_checkpoint"] = True
    if setting == "zero3":
        config["zero"] = 3
    elif setting.startswith("gemini"):
        config["zero"] = dict(stage=3, offload=True, delayed_update=setting == "gemini-dpu")
    return config


def measure(setting: str, cfg, args) -> dict:
    """Build, warm up, time ``args.steps`` steps; one row of the table."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem * GIB / total), device)
    if setting.startswith("gemini"):
        need = host_bytes(gemini_plan(cfg), 2, bf16=True)
        if need > args.host_mem * GB:
            raise MemoryError(
                f"host memory: Gemini needs {need / GB:.1f} GB for {cfg.num_params() / 1e9:.2f}B "
                f"parameters (16 bytes each), over --host-mem {args.host_mem:g} GB"
            )
    if setting == "plain":
        loop = Plain(cfg, device, args.recompute)
    else:
        config = config_of(setting, args.recompute, args.accumulation)
        ctx = gt.launch(config, 0, 1, "127.0.0.1", args.port)
        loop = Engine(cfg, ctx, args.recompute)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    micro = [(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())] * args.accumulation
    for _ in range(args.warmup):
        loss = loop.step(micro)
    before = loop.moved()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = loop.step(micro)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    after = loop.moved()
    tokens = args.batch * args.seq * args.accumulation
    return dict(
        setting=setting,
        params=cfg.num_params(),
        tok_s=tokens / seconds,
        tflops=tokens * cfg.flops_per_token(args.seq) / seconds / 1e12,
        gpu_gib=torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else 0.0,
        host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        h2d_gb=(after["h2d"] - before["h2d"]) / args.steps / GB,
        d2h_gb=(after["d2h"] - before["d2h"]) / args.steps / GB,
        loss=loss,
        accumulation=args.accumulation,
    )


def deepspeed_measure(stage: int, cfg, args) -> dict:
    """DeepSpeed ZeRO-Offload (``--peer deepspeed``): stage 2 or 3, optimizer (stage 3 also
    parameters) in CPU memory, its CPU Adam, bf16, the same model and batches."""
    import deepspeed  # noqa: PLC0415 - optional peer

    torch.cuda.set_per_process_memory_fraction(
        min(1.0, args.gpu_mem * GIB / torch.cuda.get_device_properties(0).total_memory)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    model = build(cfg, "cpu")
    for block in list(model)[1:-1]:
        block.forward = functools.partial(
            torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False
        )
    engine, *_ = deepspeed.initialize(model=model, config=_deepspeed_config(stage, args))
    loss_fn = gpt_model.GPTLoss()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).cuda()
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step():
        for _ in range(args.accumulation):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.batch * args.seq * args.accumulation
    return dict(
        setting=f"deepspeed-z{stage}",
        params=cfg.num_params(),
        tok_s=tokens / seconds,
        tflops=tokens * cfg.flops_per_token(args.seq) / seconds / 1e12,
        gpu_gib=torch.cuda.max_memory_allocated() / GIB,
        host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        h2d_gb=float("nan"),
        d2h_gb=float("nan"),
        loss=loss.item(),
        accumulation=args.accumulation,
    )


def _deepspeed_config(stage: int, args) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accumulation,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }


def probe(args) -> None:
    """One setting and size in this process: prints ``PROBE {json}`` (a row or a failure)."""
    cfg = gpt_config(args.size, args.seq, args.vocab)
    try:
        if args.setting.startswith("deepspeed"):
            row = deepspeed_measure(int(args.setting[-1]), cfg, args)
        else:
            row = measure(args.setting, cfg, args)
    except torch.OutOfMemoryError as e:
        row = dict(setting=args.setting, params=cfg.num_params(), fail=_oom(e, cfg, args))
    except MemoryError as e:
        row = dict(setting=args.setting, params=cfg.num_params(), fail=str(e))
    print("PROBE " + json.dumps(row), flush=True)


def _oom(error: Exception, cfg, args) -> str:
    """The failure, and the setting that fits by ``offload_plan`` (the estimate's bytes)."""
    text = str(error).splitlines()[0].split(". GPU")[0]
    params = device_param_bytes(gemini_plan(cfg), 2) / GIB
    if args.setting.startswith("gemini"):
        fit = max(0.0, args.gpu_mem * GIB * AUTO_FRACTION - 2 * GIB) / 2**20
        hint = f"zero.device_param_mb={fit:.0f} streams the rest"
    else:
        hint = f"zero=dict(stage=3, offload=True) keeps {params:.1f} GiB of bf16 parameters"
    return f"out of GPU memory ({text}); {hint}"


# ---- the search and the table -----------------------------------------------------------------
def run_probe(setting: str, size: str, args, accumulation: int) -> dict:
    cmd = [sys.executable, __file__, "probe", "--setting", setting, "--size", size]
    cmd += ["--device", args.device, "--gpu-mem", str(args.gpu_mem)]
    cmd += ["--host-mem", str(args.host_mem), "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--accumulation", str(accumulation), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--vocab", str(args.vocab)]
    cmd += ["--port", str(args.port + 1 + hash((setting, size, accumulation)) % 2000)]
    if not args.recompute:
        cmd.append("--no-recompute")
    params = gpt_config(size, args.seq, args.vocab).num_params()
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.probe_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return dict(setting=setting, size=size, params=params, fail="timeout")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    if lines:
        row = json.loads(lines[-1][6:])
    else:
        why = "killed (host memory)" if out.returncode in (-9, 137) else f"exit {out.returncode}"
        tail = [ln for ln in (out.stderr + out.stdout).splitlines() if ln.strip()][-1:]
        row = dict(setting=setting, params=params, fail=f"{why}: {''.join(tail)[-160:]}")
    row["size"] = size
    print(f"  {setting} {size}: {row.get('fail') or 'trains'}", file=sys.stderr, flush=True)
    print("  " + json.dumps(row), file=sys.stderr, flush=True)  # kept if the search is cut short
    return row


def largest(setting: str, ladder: str, args) -> tuple[dict | None, list[dict]]:
    """The largest size of ``ladder`` that trains, by bisection over the sizes ordered by
    parameters (a size trains if a larger one does); and every probe, smallest first."""
    sizes = sorted(filter(None, ladder.split(",")), key=lambda n: _params(n, args))
    lo, hi, seen = -1, len(sizes), {}  # sizes[lo] trains (or lo = -1), sizes[hi] fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen[mid] = run_probe(setting, sizes[mid], args, args.accumulation)
        lo, hi = (lo, mid) if "fail" in seen[mid] else (mid, hi)
    rows = [seen[i] for i in sorted(seen)]
    return (seen[lo] if lo >= 0 else None), rows


def _params(size: str, args) -> int:
    return gpt_config(size, args.seq, args.vocab).num_params()


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        "| setting | size | parameters | accum | tokens/s | model TFLOP/s | peak GPU GiB "
        "| peak host GB | H2D GB/step | D2H GB/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['setting']} | {r['size']} | {r['params'] / 1e9:.2f}B"
        if "fail" in r:
            print(f"{head} | - | {r['fail']} | | | | | |")
            continue
        print(
            f"{head} | {r['accumulation']} | {r['tok_s']:,.0f} | {r['tflops']:.1f} "
            f"| {r['gpu_gib']:.1f} | {r['host_gb']:.1f} | {r['h2d_gb']:.2f} | {r['d2h_gb']:.2f} |"
        )


def gpu_run(args) -> None:
    settings = ["plain", "zero3", "gemini"]
    best, probes = {}, []
    for s in settings:
        best[s], seen = largest(s, getattr(args, s), args)
        probes += seen
    if args.dpu and best["gemini"]:
        probes.append(run_probe("gemini-dpu", best["gemini"]["size"], args, args.accumulation))
        best["gemini-dpu"] = probes[-1] if "fail" not in probes[-1] else None
    print_table(
        f"largest GPT under {args.gpu_mem:g} GiB of GPU memory (host cap {args.host_mem:g} GB), "
        f"{args.batch} x {args.seq} tokens x {args.accumulation} micro-steps per step, bf16",
        probes,
    )
    names = args.single.split(",")
    single = [run_probe(s, best[s]["size"], args, 1) for s in names if best.get(s)]
    print_table("the largest sizes again, no accumulation", single)
    _ratios(best, single, args.accumulation)
    if not args.mid:
        return _write(args, probes, [], single)
    mid = [run_probe(s, args.mid, args, args.accumulation) for s in settings]
    if args.dpu:
        mid.append(run_probe("gemini-dpu", args.mid, args, args.accumulation))
    if args.peer == "deepspeed":
        mid += [run_probe(f"deepspeed-z{z}", args.mid, args, args.accumulation) for z in (2, 3)]
    print_table(f"fixed size {args.mid} in every setting", mid)
    _write(args, probes, mid, single)


def _write(args, probes: list, mid: list, single: list) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(dict(largest=probes, mid=mid, single=single)))


def _ratios(best: dict, single: list[dict], accumulation: int) -> None:
    """Against plain's largest size that trained: parameters, model FLOP rate at
    ``accumulation`` micro-steps and without accumulation (issue 36's targets beside)."""
    plain = best.get("plain")
    rows = {r["setting"]: r for r in single if "fail" not in r}
    print(f"\nratios against plain's largest ({plain['size'] if plain else 'none trained'})")
    print("| setting | size | parameters | model FLOP rate, accum "
          f"{accumulation} | without accumulation |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in ("gemini", "gemini-dpu"):
        row = best.get(name)
        if not plain or not row:
            continue
        alone = "-"
        if "plain" in rows and name in rows:
            alone = f"{rows[name]['tflops'] / rows['plain']['tflops']:.2f}x"
        print(
            f"| {name} | {row['size']} | {row['params'] / plain['params']:.2f}x "
            f"| {row['tflops'] / plain['tflops']:.2f}x | {alone} |"
        )
    print("targets (issue 36, gemini without delayed_update): >= 5x the parameters, >= 0.9x "
          f"the FLOP rate at {accumulation} micro-steps, >= 0.6x without accumulation")  # fmt: skip


# ---- --quick: parity and the bytes formula on the CPU -------------------------------------------
def _quick_batches(cfg, steps: int, batch: int) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (steps, batch, cfg.block_size + 1), generator=g)
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in ids]


def _quick_dense(cfg, batches) -> tuple[list[float], dict]:
    model = gpt_model.GPT(cfg).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = gpt_model.GPTLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _quick_gemini(cfg, batches, accumulation: int, port: int, device: str, bf16: bool = False):
    size = 2 if bf16 else 8  # bytes per element of the device copy
    root = cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd + 2 * cfg.n_embd
    zero = dict(stage=3, offload=True, device_param_mb=root * size / 2**20)  # the root chunk only
    config = dict(zero=zero, gradient_accumulation=accumulation)
    if bf16:
        config["fp16"] = dict(mode="bf16")
    gt.launch(config, 0, 1, "127.0.0.1", port, backend="gloo" if device == "cpu" else None)
    model = gpt_model.GPT(cfg).float() if bf16 else gpt_model.GPT(cfg).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = gt.initialize(model, opt, gpt_model.GPTLoss())
    losses, moved = [], []
    for x, y in batches:
        engine.zero_grad()
        window = []
        for xm, ym in zip(x.to(device).chunk(accumulation), y.to(device).chunk(accumulation)):
            loss = engine.criterion(engine(xm), ym)
            engine.backward(loss)
            window.append(loss.item())
        engine.step()
        losses.append(sum(window) / accumulation)
        moved.append(dict(engine.zero.transfer_bytes()))
    chunks = [c.shape() for c in engine.zero.chunks]
    state = gt.full_state_dict(engine.model)
    gt.destroy()
    return losses, state, moved, chunks


def _per_step(moved: list[dict]) -> dict[str, int]:
    return {k: moved[-1][k] - moved[-2][k] for k in ("h2d", "d2h")}


def quick(args) -> None:
    """Parity with a float64 single-process loop, and bytes moved against the formula; then
    a bf16 run: its bytes against the formula, half an fp32 link's, its losses near."""
    cfg = gpt_model.GPTConfig(**QUICK)
    steps, accumulation = 3, 2
    batches = _quick_batches(cfg, steps, 4)
    d_losses, d_state = _quick_dense(cfg, batches)
    device = "cpu" if args.device == "auto" else args.device
    losses, state, moved, chunks = _quick_gemini(cfg, batches, accumulation, args.port, device)
    # float64: only the order of additions differs (host sums, fused CPU AdamW), ~1e-16;
    # a stale or wrong device copy moves the loss by O(lr) = 1e-2
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, d_losses))
    weight_err = max((state[k] - v).abs().max().item() for k, v in d_state.items())
    per_step = _per_step(moved)
    want = transfer_per_step(chunks, accumulation, compute_bytes=8, master_bytes=8)
    resident = sum(c.resident for c in chunks)
    print(f"\nGemini on {device}, GPT {cfg.num_params() / 1e3:.0f}K float64, {len(chunks)} chunks "
          f"({resident} resident), {accumulation} micro-steps per step; then bf16")  # fmt: skip
    print("| check | measured | expected | ok |")
    print("|---|---|---|---|")
    checks = [
        ("loss rel. error", f"{loss_err:.1e}", "<= 1e-10", loss_err <= 1e-10),
        ("weight abs. error", f"{weight_err:.1e}", "<= 1e-8", weight_err <= 1e-8),
    ]
    for key in ("h2d", "d2h"):
        checks.append((f"{key} bytes/step", str(per_step[key]), str(want[key]), per_step == want))
    checks += _quick_bf16(cfg, batches, accumulation, args.port + 1, device, d_losses)
    for name, got, expected, ok in checks:
        print(f"| {name} | {got} | {expected} | {'yes' if ok else 'NO'} |")
    if not all(ok for *_, ok in checks):
        raise SystemExit("offload --quick: a check failed")


def _quick_bf16(cfg, batches, accumulation, port, device, d_losses) -> list[tuple]:
    """bf16: gradients cross the link in bf16 (summed in fp32 on the host), the resident
    masters go up in bf16; a streamed chunk's fetches were bf16 already."""
    losses, _, moved, chunks = _quick_gemini(cfg, batches, accumulation, port, device, True)
    per_step = _per_step(moved)
    want = transfer_per_step(chunks, accumulation, 2, 4, bf16=True)
    fp32_link = transfer_per_step(chunks, accumulation, 2, 4, bf16=False)
    fp32_link["h2d"] += sum(c.segment * 2 for c in chunks if c.resident)  # fp32 uploads
    # bf16 keeps 8 mantissa bits: over 3 steps of lr 1e-2 the loss (~4.9) moves ~1e-3 from
    # the float64 run's (measured 1.0e-3 on the CPU); a lost micro-step or a stale upload moves
    # it by the steps' whole change (~0.1)
    err = max(abs(a - b) for a, b in zip(losses, d_losses))
    out = [("bf16 loss abs. error", f"{err:.1e}", "<= 1e-2", err <= 1e-2)]
    for key in ("h2d", "d2h"):
        ratio = per_step[key] / fp32_link[key]
        out.append((f"bf16 {key} bytes/step", f"{per_step[key]} ({ratio:.2f}x fp32's)",
                    str(want[key]), per_step[key] == want[key]))  # fmt: skip
    return out


def cpu_adam(args) -> None:
    """The host step's kernels: AdamW over ``--adam-params`` fp32 elements in 64 tensors,
    fused (one vectorised multi-threaded kernel), foreach and for-loop, best of three."""
    n = int(args.adam_params)
    print(f"\nCPU AdamW, {n / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads")
    print("| kernel | ms/step | M params/s | GB/s (28 B/param) |")
    print("|---|---|---|---|")
    for kind in ("fused", "foreach", "for-loop"):
        params = [torch.nn.Parameter(torch.randn(n // 64)) for _ in range(64)]
        for p in params:
            p.grad = torch.randn_like(p)
        kw = {"fused": True} if kind == "fused" else {"foreach": kind == "foreach"}
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        opt.step()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        print(f"| {kind} | {best * 1e3:.0f} | {n / best / 1e6:,.0f} | {28 * n / best / GB:.1f} |")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="run", choices=["run", "probe", "cpu-adam"])
    p.add_argument("--adam-params", type=float, default=5e8, help="cpu-adam: elements")
    p.add_argument("--quick", action="store_true", help="CPU: parity and bytes per step")
    p.add_argument("--device", default="auto", help="cuda (cpu for --quick)")
    p.add_argument("--gpu-mem", type=float, default=24.0, help="GiB of GPU memory allowed")
    p.add_argument("--host-mem", type=float, default=100.0, help="GB of host state allowed")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--accumulation", type=int, default=8, help="micro-steps per step")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-recompute", dest="recompute", action="store_false")
    for setting in ("plain", "zero3", "gemini"):
        p.add_argument(f"--{setting}", default=LADDER, help=f"sizes {setting} searches")
    p.add_argument("--mid", default="760M", help="the size every setting trains ('' skips)")
    p.add_argument("--dpu", action="store_true", help="also gemini with delayed_update")
    p.add_argument(
        "--single", default="plain,gemini,gemini-dpu", help="largest sizes rerun unaccumulated"
    )
    p.add_argument("--peer", choices=["deepspeed"], default=None)
    p.add_argument("--out", default=None, help="also write every row as JSON here")
    p.add_argument("--probe-timeout", type=int, default=300)
    p.add_argument("--setting", default="gemini", help="probe: the setting")
    p.add_argument("--size", default="1.3B", help="probe: the size")
    p.add_argument("--port", type=int, default=29611)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "auto" and not args.quick:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        return quick(args)
    if args.what == "probe":
        return probe(args)
    if args.what == "cpu-adam":
        return cpu_adam(args)
    return gpu_run(args)


if __name__ == "__main__":
    main()
