"""Where a training step's time goes: the plain loop against the engine, under torch.profiler.

    python scripts/profile_step.py --preset small --steps 5 [--extra fast|fp8|fast+fp8]

For each loop of ``benchmarks/gpt_throughput.py`` it profiles a few steps after warm-up
and prints the wall time per step, the GPU-busy time per step (union of kernel
intervals), the idle remainder, host-device syncs, and the kernels that take the most
time, so an engine/plain gap can be split into "more GPU work" and "GPU waiting".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt_throughput as gb  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402


def busy_us(events) -> float:
    """Microseconds during which at least one kernel ran (overlaps counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


# kernel-name fragments by kind: GEMMs and attention are the same library kernels in every
# loop, so an engine/plain gap lives in the rest
KINDS = {
    "gemm": ("nvjet", "gemm", "cutlass", "xmma", "triton_mm", "splitK"),
    "attention": ("sdpa", "flash", "fmha", "attention"),
    "optimizer": ("FusedOpti", "multi_tensor_apply"),
}


def report(name: str, step, batches, steps: int) -> None:
    """Profile ``steps`` calls of ``step(batch)`` after 5 untimed ones; print the summary."""
    for i in range(5):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(10):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) / 10 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e6
    events = prof.events()
    # GPU-side user annotations ("Optimizer.step#AdamW.step") span kernels: not kernels
    kernels = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name
    ]
    busy = busy_us(kernels) / steps
    syncs = sum(
        1
        for e in events
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    )
    memcpy = sum(1 for e in events if "Memcpy" in e.name and "DtoH" in e.name)
    print(
        f"\n== {name}: wall {plain_ms:.2f} ms/step ({wall / 1e3:.2f} profiled), GPU busy {busy / 1e3:.2f} ms, "
        f"idle {(wall - busy) / 1e3:.2f} ms; kernels/step {len(kernels) / steps:.0f}; "
        f"syncs {syncs / steps:.1f}/step; DtoH copies {memcpy / steps:.1f}/step"
    )
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, keys in KINDS.items() if any(w in e.name for w in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.time_range.end - e.time_range.start
    print("  by kind: " + ", ".join(f"{k} {v / steps / 1e3:.2f} ms" for k, v in kinds.items()))
    per: dict[str, list[float]] = {}
    for e in kernels:
        per.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:30]
    for k, v in top:
        print(f"  {sum(v) / steps / 1e3:8.3f} ms  x{len(v) / steps:5.1f}  {k[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--extra",
        default="fast",
        help="comma list of engine rows, EXTRAS names joined with '+' (fast, fast+fp8, ...)",
    )
    a = p.parse_args()
    args = gb.parse_args(
        ["--device", "cuda", "--compile", "--batch-size", str(a.batch_size), "--presets", a.preset]
    )
    gb.gt.launch(gb.config_for(args), 0, 1, "127.0.0.1", gb.free_port())
    cfg = gpt_model.preset(a.preset, block_size=1024)
    batches = gb.make_batches(cfg, args, "cuda")
    report("plain compiled", gb.PlainLoop(cfg, args, "cuda").step, batches, a.steps)
    for spec in a.extra.split(","):
        loop = gb.EngineLoop(cfg, args, "cuda", gb.extra_for(spec))
        report(f"engine {spec}", loop.step, batches, a.steps)
        del loop
    gb.gt.destroy()


if __name__ == "__main__":
    main()
