"""Measured pipeline bubble (idle fraction per stage) of 1F1B and interleaved 1F1B vs theory.

Every stage does the same work per micro-batch: forward ``t_f``, backward
``t_b`` (sleeping on CPU, fixed matmuls on GPU), split evenly over its
``v`` chunks. With ``p`` stages and ``m`` micro-batches, 1F1B runs for
``(m + p - 1)(t_f + t_b)`` of which each stage computes ``m (t_f + t_b)``: idle
fraction ``(p - 1) / (m + p - 1)``. Interleaving ``v`` chunks shrinks the
fill/drain phases to ``(p - 1)(t_f + t_b) / v`` (Narayanan et al. 2021, Sec. 2.2),
so the idle fraction is ``((p-1)/v) / (m + (p-1)/v) = (p - 1) / (v m + p - 1)``.
Measured = 1 - (compute time of the stage) / (wall time of the step), the
median over the measured steps (other jobs on a shared machine disturb single
steps); the difference from theory is p2p latency and Python overhead. "in p2p"
is the part of the step spent inside ``PipelineP2P.communicate`` (waiting for the
neighbour, or for the message), "rounds" the ``batch_isend_irecv`` calls per step.

With one device (exactly one GPU, or ``--single``) there is no pipeline to
measure; the script measures the schedule's own cost instead: the engine's 1F1B
and interleaved schedules at pipeline size 1 (the chunks hand their activations
to themselves) against a plain loop over the same micro-batches, in ms per
micro-batch.

    python benchmarks/pipeline_bubble.py                 # CPU, gloo, p = 2 and 4
    python benchmarks/pipeline_bubble.py --stages 2 4 8  # GPUs when present (NCCL)
    python benchmarks/pipeline_bubble.py --single        # one device: schedule overhead
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
from rank_procs import rank_context  # the sibling module (benchmarks/ is sys.path[0])
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
            probe = _P2PProbe(engine.schedule.p2p)
            # the input needs a gradient too, so the first stage's backward costs what others' do
            x = torch.randn(m * mb, dim, device=ctx.device, requires_grad=True)
            idle, in_p2p, rounds = [], [], []
            for step in range(args.steps + 1):
                comm.all_reduce_(torch.zeros(1, device=ctx.device), ctx.group())  # align start
                probe.reset()
                start = time.perf_counter()
                engine.zero_grad()
                engine.execute_schedule(iter([(x, x)]), return_output_label=False)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
                engine.step()
                if step:  # the first step warms up allocations and communicators
                    idle.append(1 - engine.schedule.compute_s / wall)
                    in_p2p.append(probe.seconds / wall)
                    rounds.append(probe.rounds)
            mine = tuple(statistics.median(xs) for xs in (idle, in_p2p, rounds))
            per_stage = comm.all_gather_object(mine, ctx.group())
            rows.append((world, m, v, per_stage))
    if rank == 0:
        out.put((rows, "cuda" if cuda else "cpu"))
    gt.destroy()


class _P2PProbe:
    """Seconds inside ``communicate`` and ``batch_isend_irecv`` rounds of one stage's p2p
    (wraps the instance, so it measures any version of ``PipelineP2P``)."""

    def __init__(self, p2p):
        self.seconds, self.rounds = 0.0, 0
        communicate, batch = p2p.communicate, p2p._batch

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return communicate(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        def counted(ops):
            self.rounds += bool(ops)
            return batch(ops)

        p2p.communicate, p2p._batch = timed, counted

    def reset(self) -> None:
        self.seconds, self.rounds = 0.0, 0


# ---- one device: the schedule's own overhead -----------------------------------------------
def _single(args) -> None:
    """ms per micro-batch: a plain loop vs the engine's schedules at pipeline size 1."""
    from gridtrain.engine.schedules import InterleavedPipelineSchedule, PipelineSchedule
    from gridtrain.parallel.pipeline.partition import build_stage

    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    ctx = gt.launch(dict(num_microbatches=1), 0, 1, "127.0.0.1", _free_port(), backend=backend)
    device = ctx.device
    dim, mb = (args.dim, args.mb or args.dim) if cuda else (args.cpu_dim, args.mb or 16)
    layers = args.layers
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[MatmulLayer(dim, args.reps) for _ in range(layers)]).to(device)

    rows = []
    criterion = nn.MSELoss()
    for m in args.microbatches:
        x = torch.randn(m * mb, dim, device=device)
        plain = model()

        def run_plain(plain=plain, x=x, m=m):
            for xi in x.chunk(m):
                (criterion(plain(xi), xi) / m).backward()

        runs = {"plain loop": (run_plain, None)}
        engines = []
        for v in args.chunks:
            if layers % v:
                continue
            stage, _ = build_stage(model(), 0, 1, v, device=device)
            opt = torch.optim.SGD(stage.parameters(), lr=0.0)
            engine, *_ = gt.initialize(stage, opt, criterion, ctx=ctx)
            engine.schedule = (
                InterleavedPipelineSchedule(ctx, m, v) if v > 1 else PipelineSchedule(ctx, m)
            )
            engines.append(engine)

            def run_engine(engine=engine, x=x):
                engine.execute_schedule(iter([(x, x)]), return_output_label=False)

            name = "1F1B (p=1)" if v == 1 else f"interleaved v={v} (p=1)"
            runs[name] = (run_engine, engine)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rnd in range(args.warmup + args.rounds):
            for name, (fn, engine) in runs.items():  # alternate: drifts hit every row alike
                plain.zero_grad(set_to_none=True)
                for e in engines:
                    e.zero_grad()
                sync()
                start = time.perf_counter()
                fn()
                sync()
                if rnd >= args.warmup:
                    times[name].append((time.perf_counter() - start) / m * 1e3)
                if engine is not None:
                    engine.step()  # closes the micro-step (lr 0), not timed
        base = statistics.median(times["plain loop"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            rows.append((m, name, ms, ms - base, ms / base))
    gt.destroy()
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(
        f"pipeline schedule overhead on one device ({where}): {layers} layers of {args.reps} "
        f"[{mb}x{dim}] @ [{dim}x{dim}] matmuls, median of {args.rounds} rounds"
    )
    print(f"{'m':>4} {'schedule':<24} {'ms/micro-batch':>15} {'overhead ms':>12} {'ratio':>7}")
    for m, name, ms, extra, ratio in rows:
        print(f"{m:>4} {name:<24} {ms:>15.3f} {extra:>12.3f} {ratio:>7.3f}")


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
    one = parser.add_argument_group("one device (--single, or exactly one GPU)")
    one.add_argument("--single", action="store_true", help="schedule overhead on one device")
    one.add_argument("--layers", type=int, default=8, help="layers (a multiple of each chunks)")
    one.add_argument("--mb", type=int, default=None, help="rows per micro-batch (GPU: dim)")
    one.add_argument("--cpu-dim", type=int, default=64, help="matmul size on CPU")
    one.add_argument("--rounds", type=int, default=20, help="measured rounds per schedule")
    one.add_argument("--warmup", type=int, default=3, help="rounds before measuring")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.single or (torch.cuda.device_count() == 1 and not args.cpu):
        _single(args)
        return
    spawn = rank_context()
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
    print(
        f"{'p':>3} {'m':>4} {'v':>3} {'schedule':<12} {'theory':>7} {'mean':>7} {'in p2p':>7} "
        f"{'rounds':>7}  per stage"
    )
    for p, m, v, per_stage in rows:
        name = "1F1B" if v == 1 else "interleaved"
        idle, in_p2p, rounds = ([s[i] for s in per_stage] for i in range(3))
        stages = " ".join(f"{x:.3f}" for x in idle)
        print(
            f"{p:>3} {m:>4} {v:>3} {name:<12} {_theory(p, m, v):>7.3f} "
            f"{statistics.mean(idle):>7.3f} {statistics.mean(in_p2p):>7.3f} "
            f"{statistics.mean(rounds):>7.1f}  {stages}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
