"""Measured pipeline bubble (idle fraction per stage) of 1F1B and interleaved 1F1B vs theory.

Every stage does the same work per micro-batch: forward ``t_f``, backward
``t_b`` (sleeping on CPU, fixed matmuls on GPU), split evenly over its
``v`` chunks. With ``p`` stages and ``m`` micro-batches, 1F1B runs for
``(m + p - 1)(t_f + t_b)`` of which each stage computes ``m (t_f + t_b)``: idle
fraction ``(p - 1) / (m + p - 1)``. Interleaving ``v`` chunks shrinks the
fill/drain phases to ``(p - 1)(t_f + t_b) / v`` (Narayanan et al. 2021, Sec. 2.2),
so the idle fraction is ``((p-1)/v) / (m + (p-1)/v) = (p - 1) / (v m + p - 1)``.
Measured = 1 - (compute time of the stage) / (wall time of the step); the
difference from theory is p2p latency and Python overhead.

    python benchmarks/pipeline_bubble.py                 # CPU, gloo, p = 2 and 4
    python benchmarks/pipeline_bubble.py --stages 2 4 8  # GPUs when present (NCCL)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch import nn

import gridtrain as gt
from gridtrain.parallel import comm


class _Work(torch.autograd.Function):
    """Forward costs ``fwd_s``, backward ``2 * fwd_s`` (sleep), values pass through."""

    @staticmethod
    def forward(ctx, x, fwd_s):
        ctx.fwd_s = fwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.fwd_s)
        return grad, None


class SleepLayer(nn.Module):
    def __init__(self, dim: int, fwd_s: float):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))
        self.fwd_s = fwd_s

    def forward(self, x):
        return _Work.apply(x + self.w, self.fwd_s)


class MatmulLayer(nn.Module):
    """GPU work: ``reps`` square matmuls (backward costs about twice the forward)."""

    def __init__(self, dim: int, reps: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.reps = reps

    def forward(self, x):
        for _ in range(self.reps):
            x = torch.tanh(x @ self.w)
        return x


def _theory(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _run(rank: int, world: int, port: int, args, out):
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world and not args.cpu
    cfg = dict(parallel=dict(pipeline=world), num_microbatches=1)
    ctx = gt.launch(cfg, rank, world, "127.0.0.1", port, backend="nccl" if cuda else "gloo")
    rows = []
    for v in args.chunks:
        for m in args.microbatches:
            if v > 1 and m % world:
                continue
            ctx.config.num_microbatches = m
            ctx.config.parallel.pipeline.num_chunks = v
            if cuda:
                layers = [MatmulLayer(args.dim, max(1, args.reps // v)) for _ in range(world * v)]
                mb = args.dim
            else:
                layers = [SleepLayer(8, args.fwd_ms / 1000 / v) for _ in range(world * v)]
                mb = 2
            dim = layers[0].w.shape[0]
            # a fixed activation shape skips the per-message shape header
            ctx.config.parallel.pipeline.tensor_shape = (mb, dim) if args.fixed_shape else None
            model = nn.Sequential(*layers)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            engine, *_ = gt.initialize(model, opt, nn.MSELoss(), ctx=ctx)
            engine.schedule.timing = True
            # the input needs a gradient too, so the first stage's backward costs what others' do
            x = torch.randn(m * mb, dim, device=ctx.device, requires_grad=True)
            idle = []
            for step in range(args.steps + 1):
                comm.all_reduce_(torch.zeros(1, device=ctx.device), ctx.group())  # align start
                start = time.perf_counter()
                engine.zero_grad()
                engine.execute_schedule(iter([(x, x)]), return_output_label=False)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
                engine.step()
                if step:  # the first step warms up allocations and communicators
                    idle.append(1 - engine.schedule.compute_s / wall)
            per_stage = comm.all_gather_object(statistics.mean(idle), ctx.group())
            rows.append((world, m, v, per_stage))
    if rank == 0:
        out.put((rows, "cuda" if cuda else "cpu"))
    gt.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up)")
    parser.add_argument("--fwd_ms", type=float, default=20.0, help="CPU: forward ms per stage")
    parser.add_argument("--dim", type=int, default=4096, help="GPU: matmul size")
    parser.add_argument("--reps", type=int, default=8, help="GPU: matmuls per stage forward")
    parser.add_argument("--cpu", action="store_true", help="use gloo on CPU even with GPUs")
    parser.add_argument(
        "--fixed-shape", action="store_true", help="set parallel.pipeline.tensor_shape"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn = mp.get_context("spawn")
    device = "cpu"
    rows = []
    for p in args.stages:
        out = spawn.Queue()
        port = _free_port()
        procs = [spawn.Process(target=_run, args=(r, p, port, args, out)) for r in range(p)]
        for proc in procs:
            proc.start()
        got, device = out.get()
        rows += got
        for proc in procs:
            proc.join()
    shapes = "fixed tensor_shape" if args.fixed_shape else "shape exchange"
    print(f"pipeline bubble on {device} ({shapes}): idle fraction per stage, measured vs theory")
    print(f"{'p':>3} {'m':>4} {'v':>3} {'schedule':<12} {'theory':>7} {'mean':>7}  per stage")
    for p, m, v, per_stage in rows:
        name = "1F1B" if v == 1 else "interleaved"
        stages = " ".join(f"{x:.3f}" for x in per_stage)
        print(
            f"{p:>3} {m:>4} {v:>3} {name:<12} {_theory(p, m, v):>7.3f} "
            f"{statistics.mean(per_stage):>7.3f}  {stages}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
