"""GPT-2 training throughput: gridtrain's default config against plain PyTorch, eager and
compiled, and 1d TP.

    python benchmarks/gpt_throughput.py                 # H200: 124M and 350M, seq 1024, bf16
    python benchmarks/gpt_throughput.py --device cpu    # tiny preset, short sequences (~1 min)
    python benchmarks/gpt_throughput.py --presets medium --try fast+cdt
                                                        # more engine rows: EXTRAS joined by '+'

Each row trains the same model (``demos/gpt/model.py``) on random tokens:
``plain eager`` is the loop everyone writes (autocast bf16, fused AdamW, fp32 master
weights), ``plain compiled`` the same with ``torch.compile(model)``; ``engine`` is
``gt.initialize`` with no parallelism and ``fp16 = dict(mode=AMP_TYPE.BF16)`` and no speed
key, so it runs the device's defaults (on CUDA: blocks and loss compiled, cuDNN attention
first on Hopper, fused AdamW), driven by ``engine.execute_schedule``. The rows alternate
for ``--rounds`` rounds and each keeps its best round, so clock drift hits all alike; the
table gives each engine row's ratio to both plain rows, and each row's first step (most
of it compilation). With several GPUs, ``engine tp=N`` rows run the engine under 1d tensor
parallelism on N GPUs (same global batch), one process each.

MFU = tokens/s x FLOPs per token / (GPUs x peak), FLOPs per token =
6·N (N = parameters without the position table) + 12·L·H·S for attention
(PaLM appendix B; causal masking not discounted). The dense bf16 peak is
989 TFLOP/s for H100/H200 SXM (no sparsity); ``--peak-tflops`` overrides it.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
from benchmarks.rank_procs import rank_context  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402
from gridtrain.amp import AMP_TYPE  # noqa: E402

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense bf16, SXM


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--presets", default=None, help="comma list (default small,medium; cpu tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu 64)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="sequences/step (default 16; cpu 8)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (20; cpu 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    p.add_argument("--rounds", type=int, default=3, help="alternating plain/engine rounds")
    p.add_argument(
        "--tp", default=None, help="1d TP sizes, e.g. 2,4,8 (default: those the GPUs allow)"
    )
    p.add_argument(
        "--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 (cpu fp32)"
    )
    p.add_argument(
        "--plain",
        default=None,
        help="plain rows, comma list of eager,compiled (default both; cpu eager: a C++ build)",
    )
    p.add_argument(
        "--compile", action="store_true", help="a PlainLoop built without 'compiled' compiles"
    )
    p.add_argument("--fp8", action="store_true", help="also an 'engine fp8' row (torchao float8)")
    p.add_argument(
        "--try",
        dest="variants",
        default="",
        help="comma list of further engine rows, each EXTRAS names joined with '+', e.g. "
        "fast+cdt,fast+fp8mlp",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="override the stated peak")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    args.device = "cuda" if cuda else "cpu"
    args.presets = (args.presets or ("small,medium" if cuda else "tiny")).split(",")
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.steps = args.steps or (20 if cuda else 5)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.plain = (args.plain or ("eager,compiled" if cuda else "eager")).split(",")
    if set(args.plain) - {"eager", "compiled"}:
        raise SystemExit(f"--plain: eager and/or compiled, got {args.plain}")
    gpus = torch.cuda.device_count() if cuda else 1
    if args.tp is None:
        args.tp = [n for n in (2, 4, 8) if n <= gpus] if cuda and _has_1d() else []
    else:
        args.tp = [int(n) for n in args.tp.split(",") if n]
    return args


def _has_1d() -> bool:
    return (Path(gt.__file__).parent / "parallel/tensor/mode_1d").is_dir()


def peak_flops(args) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"{args.peak_tflops:g} TFLOP/s (given)"
    if args.device == "cuda" and args.dtype == "bf16":
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s dense bf16 ({name})"
        return None, f"unknown for {name}: pass --peak-tflops"
    return None, "no peak stated for this device/dtype (pass --peak-tflops)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_for(args, tp: int = 1) -> dict:
    cfg = {} if args.dtype == "fp32" else dict(fp16=dict(mode=AMP_TYPE.BF16))
    if tp > 1:
        cfg["parallel"] = dict(tensor=dict(size=tp, mode="1d"))
    return cfg


def make_batches(cfg, args, device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = min(cfg.vocab_size, 50257)  # real GPT-2 token ids; padding rows never appear
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(device)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def adamw(model, device):
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )


class PlainLoop:
    """What a user writes without gridtrain: autocast, loss.backward(), fused AdamW;
    ``compiled`` (default: ``args.compile``): ``torch.compile(model)``."""

    def __init__(self, cfg, args, device, compiled: bool | None = None):
        model = gpt_model.GPT(cfg).to(device)  # gt.nn layers are plain modules until initialize
        compiled = args.compile if compiled is None else compiled
        self.model = torch.compile(model) if compiled else model
        self.opt = adamw(model, device)
        self.loss_fn = gpt_model.GPTLoss()
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else None
        self.device = device

    def step(self, batch) -> None:
        x, y = batch
        ctx = (
            torch.autocast(self.device, dtype=self.dtype)
            if self.dtype
            else contextlib.nullcontext()
        )
        with ctx:
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# what an unset config gets on a Hopper GPU (gridtrain.engine.speed), spelled out
FAST = dict(compile=True, attention=dict(backends=["cudnn", "flash", "efficient", "math"]))
# engine-only config keys by name, joined with '+' in --try and scripts/profile_step.py
EXTRAS = {
    "fast": FAST,
    "fp8": dict(fp8=True),
    # float8 in the MLP only (half the FLOPs, the widest matmuls); attention stays bf16
    "fp8mlp": dict(fp8=dict(skip=["*attn*", *gt.config.Fp8Config().skip])),
    "cdt": dict(compile=dict(options=dict(coordinate_descent_tuning=True))),
    "autotune": dict(compile=dict(mode="max-autotune-no-cudagraphs")),
    "graphs": dict(compile=dict(mode="reduce-overhead")),
    "cdtgraphs": dict(
        compile=dict(options={"coordinate_descent_tuning": True, "triton.cudagraphs": True})
    ),
    "maxautotune": dict(compile=dict(mode="max-autotune")),
    # and horizontal fusion of independent kernels (fewer launches), fusion without shared reads
    "tuned": dict(
        compile=dict(
            options=dict(coordinate_descent_tuning=True, combo_kernels=True, aggressive_fusion=True)
        )
    ),
    "zero1": dict(zero=1),
    "zero2": dict(zero=2),
}


def extra_for(spec: str) -> dict:
    """Engine config keys for ``spec``, EXTRAS names joined with '+' (later ones win)."""
    extra: dict = {}
    for part in spec.split("+"):
        if part not in EXTRAS:
            raise SystemExit(f"unknown extra {part!r}; allowed: {', '.join(EXTRAS)}")
        extra.update(EXTRAS[part])
    return extra


class EngineLoop:
    """The same model through ``gt.initialize`` and ``engine.execute_schedule``; ``extra``
    config keys (``FAST``: the engine's ``compile`` per block and cuDNN ``attention``)
    apply to this engine only; without them it runs the device's defaults."""

    def __init__(self, cfg, args, device, extra: dict | None = None):
        model = gpt_model.GPT(cfg).to(device)
        ctx = gt.get_context()
        launched = ctx.config  # every loop shares the launch; the extra keys are this one's
        if extra:
            ctx.config = gt.Config.from_dict({**launched.model_dump(exclude_unset=True), **extra})
        try:
            example = torch.zeros(1, 8, dtype=torch.long, device=device)  # traced on meta
            self.engine, *_ = gt.initialize(
                model, adamw(model, device), gpt_model.GPTLoss(), example_inputs=example
            )
        finally:
            ctx.config = launched
        self.engine.train()

    def step(self, batch) -> None:
        self.engine.zero_grad()
        self.engine.execute_schedule(iter([batch]), return_output_label=False)
        self.engine.step()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_round(loop, batches, args, device) -> float:
    """Tokens per second over ``args.steps`` steps after ``args.warmup`` untimed ones."""
    for i in range(args.warmup):
        loop.step(batches[i % len(batches)])
    sync(device)
    start = time.perf_counter()
    for i in range(args.steps):
        loop.step(batches[i % len(batches)])
    sync(device)
    return args.steps * args.batch_size * args.seq_len / (time.perf_counter() - start)


def first_step_s(loop, batch, device) -> float:
    """Seconds of ``loop``'s first step: with compilation, mostly compiling."""
    sync(device)
    start = time.perf_counter()
    loop.step(batch)
    sync(device)
    return time.perf_counter() - start


def single_device(args, preset: str) -> tuple[dict[str, float], dict[str, float]]:
    """Best-of-rounds tokens/s of the plain loops and the engine rows, alternating; and each
    row's first step in seconds."""
    cfg = gpt_model.preset(
        preset, block_size=max(args.seq_len, gpt_model.PRESETS[preset].block_size)
    )
    device = args.device
    batches = make_batches(cfg, args, device)
    loops = {f"plain {how}": PlainLoop(cfg, args, device, how == "compiled") for how in args.plain}
    loops["engine"] = EngineLoop(cfg, args, device)
    if args.fp8:
        loops["engine fp8"] = EngineLoop(cfg, args, device, extra=dict(fp8=True))
    for spec in filter(None, args.variants.split(",")):
        loops[f"engine {spec}"] = EngineLoop(cfg, args, device, extra=extra_for(spec))
    first = {name: first_step_s(loop, batches[0], device) for name, loop in loops.items()}
    best = dict.fromkeys(loops, 0.0)
    for r in range(args.rounds):
        for name, loop in loops.items():
            start = time.perf_counter()
            tok_s = timed_round(loop, batches, args, device)
            best[name] = max(best[name], tok_s)
            # progress: the first round of a compiled row includes its compilation
            print(
                f"  {preset} round {r + 1}/{args.rounds} {name}: {tok_s:,.0f} tok/s "
                f"({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    del loops
    if device == "cuda":
        torch.cuda.empty_cache()
    return best, first


def _tp_worker(rank: int, world: int, port: int, args, preset: str, queue) -> None:
    ctx = gt.launch(config_for(args, world), rank, world, "127.0.0.1", port, local_rank=rank)
    if args.device == "cpu":
        torch.set_num_threads(1)
    cfg = gpt_model.preset(
        preset, block_size=max(args.seq_len, gpt_model.PRESETS[preset].block_size)
    )
    loop = EngineLoop(cfg, args, ctx.device.type)
    batches = make_batches(cfg, args, ctx.device)
    best = max(timed_round(loop, batches, args, ctx.device.type) for _ in range(args.rounds))
    if rank == 0:
        queue.put(best)
    gt.destroy()


def tensor_parallel(args, preset: str, tp: int) -> float:
    """Tokens/s of the engine under 1d TP on ``tp`` processes (one GPU each)."""
    mp = rank_context()
    queue = mp.SimpleQueue()
    torch.multiprocessing.start_processes(
        _tp_worker,
        args=(tp, free_port(), args, preset, queue),
        nprocs=tp,
        start_method=mp.get_start_method(),
    )
    return queue.get()


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    peak, peak_note = peak_flops(args)
    if args.device == "cpu":
        torch.set_num_threads(1)  # one core per process, as in the TP workers
    gt.launch(
        config_for(args),
        0,
        1,
        "127.0.0.1",
        free_port(),
        backend="gloo" if args.device == "cpu" else None,
    )
    rows = []
    for preset in args.presets:
        cfg = gpt_model.preset(preset)
        flops = cfg.flops_per_token(args.seq_len)
        best, first = single_device(args, preset)
        for mode in best:
            rows.append(dict(preset=preset, mode=mode, gpus=1, tok_s=best[mode]))
            rows[-1]["first_s"] = first[mode]
            for how in args.plain:
                if mode.startswith("engine"):
                    rows[-1][how] = best[mode] / best[f"plain {how}"]
        for tp in args.tp:
            rows.append(
                dict(
                    preset=preset,
                    mode=f"engine 1d tp={tp}",
                    gpus=tp,
                    tok_s=tensor_parallel(args, preset, tp),
                )
            )
        for r in rows:
            if r["preset"] == preset:
                r["params_m"] = cfg.num_params() / 1e6
                r["mfu"] = r["tok_s"] * flops / (r["gpus"] * peak) if peak else None
    gt.destroy()
    print_table(rows, args, peak_note)
    return rows


def print_table(rows: list[dict], args, peak_note: str) -> None:
    print(
        f"\nGPT throughput: seq {args.seq_len}, batch {args.batch_size}, {args.dtype}, "
        f"{args.device}; engine: the default config (no speed key); best of {args.rounds} "
        f"rounds x {args.steps} steps; MFU peak: {peak_note}"
    )
    ratios = "".join(f" {'vs ' + how:>12}" for how in args.plain)
    head = (
        f"{'preset':<8} {'params':>8} {'mode':<26} {'tokens/s':>12} {'tok/s/device':>12} "
        f"{'MFU':>7} {'1st step s':>10}{ratios}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        first = f"{r['first_s']:.1f}" if "first_s" in r else "-"
        cells = "".join(f" {r[how]:>12.3f}" if how in r else f" {'':>12}" for how in args.plain)
        print(
            f"{r['preset']:<8} {r['params_m']:>7.1f}M {r['mode']:<26} {r['tok_s']:>12,.0f} "
            f"{r['tok_s'] / r['gpus']:>12,.0f} {mfu:>7} {first:>10}{cells}"
        )


if __name__ == "__main__":
    main()
