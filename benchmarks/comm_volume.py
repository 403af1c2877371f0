"""Bytes each tensor-parallel mode moves per training step, measured beside each paper's formula.

    python benchmarks/comm_volume.py                      # CPU, gloo: byte table (a few minutes)
    python benchmarks/comm_volume.py --time               # CUDA: + step time at 4 and 8 GPUs
    python benchmarks/comm_volume.py --sizes 8x16x64 --modes 3d

One transformer block (LayerNorm, QKV Linear, attention, output Linear, LayerNorm,
h -> 4h -> h MLP, two residuals), written once with ``gridtrain.nn`` so each
layout builds its own layers, runs one forward + backward on ``T`` processes
spawned here (gloo on CPU, NCCL on GPUs). ``comm.count_bytes()`` counts what
each rank sends per collective (ring all-reduce 2(n-1)/n x size, all-gather
(n-1) x input, reduce-scatter (n-1) x output, broadcast/reduce x size).
Attention itself needs no communication in any of these modes (heads are local),
so a stand-in splits each rank's QKV shard into heads and runs SDPA on them.

Analytic volume (elements per rank, M = batch x seq tokens, one Linear K -> N;
the block has K x N = h x 3h, h x h, h x 4h, 4h x h), forward + backward:

* 1d, Megatron (Shoeybi et al. 2019): one all-reduce of ``M x h`` per Linear pair
  forward, one backward: ``4 x 2(T-1)/T x M h`` for the block;
* 2d, Optimus (Xu et al. 2021): SUMMA broadcasts q panels of each operand, and
  backward's two products again (broadcast one operand, reduce the other):
  ``3 (M K + K N) / q`` per Linear;
* 2.5d, Tesseract (Wang et al. 2021): as 2d with the batch also cut over depth,
  plus the weight gradient summed over depth:
  ``3 (M K / dep + K N) / q + 2 (dep-1)/dep x K N / q^2`` per Linear;
* 3d, Bian et al. 2021: all-gather X and W, reduce-scatter Y forward; all-gather dY,
  reduce-scatter dX and dW backward: ``2 (d-1)/d^3 x (M K + K N + M N)`` per Linear.

The formulas count the matmuls only; measured bytes also include LayerNorm
statistics and the gathers of split biases / LayerNorm weights.
"""

from __future__ import annotations

import argparse
import functools
import math
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
import gridtrain.nn as gnn  # noqa: E402
from benchmarks.rank_procs import rank_context  # noqa: E402
from gridtrain.parallel import comm  # noqa: E402
from gridtrain.parallel.tensor.parallelize import apply_plan, build_plan  # noqa: E402

# (mode, tensor size, depth, module file)
LAYOUTS = [
    ("1d", 4, 1),
    ("1d", 8, 1),
    ("2d", 4, 1),
    ("2.5d", 8, 2),
    ("3d", 8, 1),
]
HEAD_DIM = 8  # 8 heads at h = 64: they split over every CPU layout (1d on 8 ranks too)


class Block(nn.Module):
    """Pre-LN transformer block from gt.nn layers (four Linears: every mode's layout returns)."""

    def __init__(self, h: int, dtype: torch.dtype):
        super().__init__()
        self.ln1 = gnn.LayerNorm(h, dtype=dtype)
        self.qkv = gnn.Linear(h, 3 * h, dtype=dtype)
        self.proj = gnn.Linear(h, h, dtype=dtype)
        self.ln2 = gnn.LayerNorm(h, dtype=dtype)
        self.fc1 = gnn.Linear(h, 4 * h, dtype=dtype)
        self.fc2 = gnn.Linear(4 * h, h, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        b, s, w = q.shape
        heads = max(1, w // HEAD_DIM)
        q, k, v = (t.reshape(b, s, heads, w // heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def grid_sizes(mode: str, t: int, depth: int) -> tuple[int, int]:
    """(batch parts, hidden parts) of an activation under the mode."""
    if mode == "1d":
        return 1, 1
    if mode == "3d":
        d = round(t ** (1 / 3))
        return d * d, d
    q = math.isqrt(t // depth)
    return depth * q, q


def analytic_elements(mode: str, t: int, depth: int, m: int, h: int) -> float:
    """Each paper's per-rank volume for the block's four Linears, forward + backward."""
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
    if mode == "1d":
        return 4 * 2 * (t - 1) / t * m * h
    if mode == "3d":
        d = round(t ** (1 / 3))
        return sum(2 * (d - 1) / d**3 * (m * k + k * n + m * n) for k, n in linears)
    q = math.isqrt(t // depth)
    total = 0.0
    for k, n in linears:
        total += 3 * (m * k / depth + k * n) / q
        total += 2 * (depth - 1) / depth * k * n / q**2
    return total


def _worker(rank, world, port, mode, depth, sizes, dtype_name, steps, queue):
    torch.set_num_threads(1)
    tensor = dict(size=world, mode=mode, **(dict(depth=depth) if mode == "2.5d" else {}))
    cfg = dict(parallel=dict(tensor=tensor))
    ctx = gt.launch(cfg, rank, world, "127.0.0.1", port)
    dtype = getattr(torch, dtype_name)
    results = []
    for b, s, h in sizes:
        torch.manual_seed(0)
        # the engine's plan and layers (gt.initialize does the same, plus an optimizer), for
        # the block as it sits in a model: its output feeds a later Linear, not the loss
        # (traced alone, proj and fc2 reach the output, so 2d/3d would gather them as heads),
        # and its input comes from a Linear (2d/3d hand a model its input full width, which
        # only a Linear takes; the block starts with a norm)
        linear = functools.partial(gnn.Linear, h, h, dtype=dtype)
        model = nn.Sequential(linear(), Block(h, dtype), linear())
        apply_plan(model, build_plan(model, ctx, torch.zeros(b, s, h, dtype=dtype)), ctx)
        block = model[1].to(ctx.device)
        rows, cols = grid_sizes(mode, world, depth)
        x = torch.randn(b // rows, s, h // cols, dtype=dtype, device=ctx.device)

        def step(block=block, x=x):
            block.zero_grad(set_to_none=True)
            block(x).float().square().mean().backward()

        with comm.count_bytes() as counted:
            step()
        times = []
        for i in range(steps + 3 if steps else 0):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:  # three warm-up steps
                times.append(time.perf_counter() - start)
        results.append((dict(counted), statistics.median(times) if times else None))
    queue.put((rank, results))
    gt.destroy()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_layout(mode, world, depth, sizes, dtype, steps):
    """Every rank's [(bytes per collective, median step seconds)] per size."""
    ctx = rank_context()
    queue = ctx.SimpleQueue()
    args = (world, _free_port(), mode, depth, sizes, dtype, steps, queue)
    procs = mp.start_processes(
        _worker, args=args, nprocs=world, start_method=ctx.get_start_method(), join=False
    )
    per_rank, done = {}, False
    while not done:
        done = procs.join(timeout=1)  # raises (with the rank's traceback) if a rank failed
        while not queue.empty():
            rank, result = queue.get()
            per_rank[rank] = result
    return [per_rank[r] for r in range(world)]


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="batch x seq x hidden list (cpu 8x16x64,8x16x128)")
    p.add_argument("--modes", default="1d,2d,2.5d,3d")
    p.add_argument("--time", action="store_true", help="also time steps (on GPUs when present)")
    p.add_argument("--steps", type=int, default=10, help="timed steps with --time")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    default = "16x512x2048,16x1024x4096" if cuda and args.time else "8x16x64,8x16x128"
    sizes = parse_sizes(args.sizes or default)
    dtype = "bfloat16" if cuda and args.time else "float32"
    gpus = torch.cuda.device_count() if cuda else None
    wanted = args.modes.split(",")
    rows = []
    for mode, world, depth in LAYOUTS:
        if mode not in wanted:
            continue
        if gpus is not None and world > gpus:
            print(f"skip {mode} T={world}: {gpus} GPUs")
            continue
        results = run_layout(mode, world, depth, sizes, dtype, args.steps if args.time else 0)
        for i, (b, s, h) in enumerate(sizes):
            counts = [r[i][0] for r in results]
            total = max(sum(c.values()) for c in counts)  # the busiest rank
            kinds = sorted({k for c in counts for k in c})
            split = " ".join(f"{k}={max(c.get(k, 0) for c in counts) / 2**20:.3f}" for k in kinds)
            ideal = (
                analytic_elements(mode, world, depth, b * s, h)
                * torch.finfo(getattr(torch, dtype)).bits
                / 8
            )
            step_s = results[0][i][1]
            rows.append((mode, world, f"{b}x{s}x{h}", total, ideal, step_s, split))
    print(f"\nbytes sent per rank per step, one transformer block, {dtype}, fwd+bwd")
    print(
        f"{'mode':<5} {'T':>2} {'b x s x h':>12} {'measured MiB':>13} {'paper MiB':>10} "
        f"{'ratio':>6} {'step ms':>8}  by collective (MiB)"
    )
    for mode, world, size, total, ideal, step_s, split in rows:
        ms = f"{step_s * 1e3:8.2f}" if step_s is not None else f"{'-':>8}"
        print(
            f"{mode:<5} {world:>2} {size:>12} {total / 2**20:13.3f} {ideal / 2**20:10.3f} "
            f"{total / ideal:6.2f} {ms}  {split}"
        )


if __name__ == "__main__":
    main()
