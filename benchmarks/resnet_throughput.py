"""ResNet-18 training throughput: gridtrain's default config against plain PyTorch, eager and
compiled.

    python benchmarks/resnet_throughput.py                      # one process
    gridtrain run --nproc_per_node 4 --config demos/resnet/configs/fp32.py \\
        benchmarks/resnet_throughput.py                         # data parallel vs torch DDP

For each precision (fp32, torch fp16, naive fp16, bf16) the same model (same
initial weights, same Adam (fused on CUDA), same fixed batch already on the device) is trained
through ``engine.execute_schedule`` + ``engine.step`` (the config names no speed key: the
device's defaults, on CUDA the repeated blocks compiled and fused Adam) and through the
textbook PyTorch loop of that precision, eager (``plain``) and under
``torch.compile(model)`` (``compiled``; CUDA only by default, ``--plain``):

* fp32: forward, loss, backward, step;
* torch_fp16: ``torch.autocast(float16)`` + ``torch.amp.GradScaler``;
* naive_fp16: fp16 model, fp32 master weights, static-or-dynamic loss scale
  with torch's fused unscale/inf check (what GradScaler uses inside);
* bf16: ``torch.autocast(bfloat16)``;
* with several processes the plain model is wrapped in torch DDP.

Fairness: warm-up steps first (cuDNN autotuning, allocator), then ``--repeats``
rounds that each time ``--steps`` steps of both sides, alternating which goes
first, with the device synchronised around every timed block; the table shows
the median images/s (global: all data-parallel ranks) and the engine's ratio to each plain
loop. The first-step losses of the engine and plain eager are printed as a check that they
do the same work. Runs on CUDA when present (the target: engine / plain >= 1.0), else on
the CPU with small defaults.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import gridtrain as gt

PRECISIONS = {
    "fp32": None,
    "torch_fp16": dict(mode="torch"),
    "naive_fp16": dict(mode="naive"),
    "bf16": dict(mode="bf16"),
}


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset")
    p.add_argument("--batch", type=int, default=128 if cuda else 8, help="per process")
    p.add_argument("--steps", type=int, default=50 if cuda else 3, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=7 if cuda else 3, help="timed rounds")
    p.add_argument("--warmup", type=int, default=20 if cuda else 1, help="untimed steps")
    p.add_argument("--stem", choices=("cifar", "imagenet"), default="cifar" if cuda else "imagenet")
    p.add_argument("--image_size", type=int, default=32)
    # CPU: torch's fp16/bf16 convolution backward in NCHW is its slow reference kernel
    # (_slow_conv2d_backward: 1.5 s a step at batch 2, 97% of the step); channels_last goes
    # through oneDNN (0.2-0.3 s). Both sides get the same format.
    p.add_argument(
        "--memory_format",
        choices=("contiguous", "channels_last"),
        default="contiguous" if cuda else "channels_last",
        help="of the model and the images (CPU default channels_last)",
    )
    p.add_argument(
        "--plain", default="eager,compiled" if cuda else "eager", help="plain loops to time"
    )
    args = p.parse_args()
    args.plain = args.plain.split(",")
    if set(args.plain) - {"eager", "compiled"}:
        p.error(f"--plain: eager and/or compiled, got {args.plain}")
    unknown = set(args.precisions.split(",")) - set(PRECISIONS)
    if unknown:
        p.error(f"--precisions: unknown {sorted(unknown)}; allowed: {', '.join(PRECISIONS)}")
    return args


def make_model(stem: str) -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    if stem == "cifar":  # 3x3/1 stem, no max-pool: full resolution on 32 x 32 images
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the plain PyTorch side -------------------------------------------------------------
def _fused(device) -> bool:
    """Fused Adam on CUDA on both sides (one kernel, and no host sync for a skipped step)."""
    return device.type == "cuda"


def plain_step_fn(
    model: nn.Module, precision: str, device, x, y, world: int, compiled: bool = False
) -> Callable:
    """One training step of the textbook loop for ``precision`` (``compiled``: through
    ``torch.compile(model)``); returns the loss."""
    if precision == "naive_fp16":
        model.half()
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    params = [p for p in model.parameters() if p.requires_grad]
    model = torch.compile(model) if compiled else model

    if precision == "naive_fp16":
        masters = [p.detach().clone().float() for p in params]
        opt = torch.optim.Adam(masters, lr=1e-3, fused=_fused(device))
        scale = torch.tensor(2.0**16, device=device)
        found_inf = torch.zeros(1, device=device)
        xh = x.half()

        def step() -> torch.Tensor:
            for p in params:
                p.grad = None
            loss = F.cross_entropy(model(xh).float(), y)
            (loss * scale).backward()
            grads = [p.grad.float() for p in params]
            found_inf.zero_()
            # DDP averaged the gradients already: every rank finds the same overflow
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, 1.0 / scale)
            if not found_inf.item():
                for m, g in zip(masters, grads):
                    m.grad = g
                opt.step()
                with torch.no_grad():  # leaf fp16 params: copy the new masters in
                    torch._foreach_copy_(params, masters)
            return loss.detach()

        return step

    opt = torch.optim.Adam(params, lr=1e-3, fused=_fused(device))
    dtype = {"torch_fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "torch_fp16" else None

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


# ---- the engine side --------------------------------------------------------------------
def engine_step_fn(model: nn.Module, precision: str, ctx, x, y) -> Callable:
    # the engine reads the fp16 section when it is built; set it for this precision
    ctx.config.fp16 = PRECISIONS[precision]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=_fused(ctx.device))
    engine, *_ = gt.initialize(model, opt, nn.CrossEntropyLoss())
    engine.train()
    batches = itertools.repeat((x, y))

    def step() -> torch.Tensor:
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(batches, return_output_label=False)
        engine.step()
        return loss

    return step


def timed(step: Callable, steps: int, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return time.perf_counter() - start


def launch() -> gt.ParallelContext:
    """Pure data parallelism over every process (the benchmark ignores other config keys)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return gt.launch_from_torch(config={})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return gt.launch({}, rank=0, world_size=1, host="127.0.0.1", port=port)


def measure(precision: str, reference: nn.Module, ctx, args, x, y) -> dict:
    """Median images/s of the engine and each plain loop for ``precision``; the first
    losses of the engine and plain eager."""
    device, world = ctx.device, ctx.world_size()
    steps = {"engine": engine_step_fn(copy.deepcopy(reference), precision, ctx, x, y)}
    for how in args.plain:
        model = copy.deepcopy(reference).to(device)
        steps[how] = plain_step_fn(model, precision, device, x, y, world, how == "compiled")
    first = {name: float(step()) for name, step in steps.items()}
    for _ in range(args.warmup - 1):
        for step in steps.values():
            step()
    rates = {name: [] for name in steps}
    order = list(steps.items())
    for r in range(args.repeats):
        for name, step in order[r % len(order) :] + order[: r % len(order)]:  # rotate who leads
            seconds = timed(step, args.steps, device)
            rates[name].append(args.batch * world * args.steps / seconds)
    del steps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(
        median={name: statistics.median(v) for name, v in rates.items()},
        spread=max(max(v) / min(v) - 1 for v in rates.values()),
        first=first,
    )


def print_table(rows: dict, args, ctx) -> None:
    device, world = ctx.device, ctx.world_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"ResNet-18 ({args.stem} stem, {args.image_size}px, {args.memory_format}), "
        f"batch {args.batch} x {world} "
        f"process(es) on {name}; engine: the default config (no speed key); {args.warmup} "
        f"warm-up, median of {args.repeats} x {args.steps} steps"
    )
    label = {"eager": "plain", "compiled": "compiled"}
    cols = "".join(f" {label[h] + ' img/s':>15}" for h in args.plain)
    ratios = "".join(f" {'vs ' + label[h]:>11}" for h in args.plain)
    print(
        f"{'precision':<11} {'engine img/s':>13}{cols}{ratios} {'spread':>7} "
        f"{'1st loss engine/plain':>22}"
    )
    for precision, r in rows.items():
        m = r["median"]
        cols = "".join(f" {m[h]:>15.1f}" for h in args.plain)
        ratios = "".join(f" {m['engine'] / m[h]:>11.3f}" for h in args.plain)
        plain_first = r["first"].get("eager", float("nan"))
        print(
            f"{precision:<11} {m['engine']:>13.1f}{cols}{ratios} {r['spread']:>6.1%} "
            f"{r['first']['engine']:>11.4f}/{plain_first:.4f}"
        )


def main() -> None:
    args = parse_args()
    ctx = launch()
    device = ctx.device
    torch.backends.cudnn.benchmark = True  # both sides, same process
    g = torch.Generator().manual_seed(ctx.global_rank)
    fmt = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}[
        args.memory_format
    ]
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g)
    x = x.to(device, memory_format=fmt)
    y = torch.randint(10, (args.batch,), generator=g).to(device)
    torch.manual_seed(0)
    reference = make_model(args.stem).to(memory_format=fmt)
    rows = {p: measure(p, reference, ctx, args, x, y) for p in args.precisions.split(",")}
    if ctx.global_rank == 0:
        print_table(rows, args, ctx)
    gt.destroy()


if __name__ == "__main__":
    main()
