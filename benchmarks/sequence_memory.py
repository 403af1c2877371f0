"""Activation memory of sequence parallelism: per rank, and the longest sequence that fits.

    python benchmarks/sequence_memory.py                      # CPU (gloo), small defaults
    python benchmarks/sequence_memory.py --budget-mb 2048 --hidden 1024 --heads 16   # GPU

For each layout (no sequence parallelism, then sequence size N with the
'standard' and 'online' ring) it trains one step of a pre-LN transformer stack
on ``[B, S/N, H]`` shards for doubling sequence lengths and records, per rank:

* ``saved``: bytes of distinct tensors autograd keeps for backward (counted by
  ``torch.autograd.graph.saved_tensors_hooks``), the activation memory that
  sequence parallelism divides; parameters and gradients are not included;
* ``peak`` (CUDA only): ``torch.cuda.max_memory_allocated`` during forward and
  backward minus what was allocated before (activations, transients, gradients).

The longest sequence is the largest length whose activation memory (``peak`` on
CUDA, ``saved`` on CPU) stays within ``--budget-mb`` per rank. Baselines without
sequence parallelism: ``dense-sdpa`` (torch's fused attention) and ``dense-math``
(the standard ring's math on one rank: ``S x S`` scores kept, as in the paper's baseline).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.nn.functional as F
from rank_procs import rank_context  # the sibling module (benchmarks/ is sys.path[0])
from torch import nn

import gridtrain as gt
from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor import sequence
from gridtrain.parallel.tensor.sequence.ring import online_attention, standard_attention


class Block(nn.Module):
    """Pre-LN transformer block whose attention is picked by ``variant``."""

    def __init__(self, hidden: int, heads: int, variant: str):
        super().__init__()
        self.heads, self.variant = heads, variant
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scale = (h // self.heads) ** -0.5
        if self.variant == "dense-sdpa":
            a = F.scaled_dot_product_attention(q, k, v)
        elif self.variant == "dense-math":  # the standard ring on a one-rank group
            a = standard_attention(q, k, v, _WORLD, False, None, 0.0, scale)
        elif self.variant == "dense-online":
            a = online_attention(q, k, v, _WORLD, False, None, 0.0, scale)
        else:
            a = sequence.ring_attention(q, k, v, variant=self.variant)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


_WORLD = None  # the one-rank world group, for the dense-math baseline


def _saved_bytes_hooks(seen: dict):
    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _one_step(model, batch, seq_local, hidden, device) -> tuple[int, int]:
    x = torch.randn(batch, seq_local, hidden, device=device, requires_grad=True)
    seen: dict[int, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with _saved_bytes_hooks(seen):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), peak


def _worker(rank, world, port, args, variant, out):
    global _WORLD
    if world > 1:
        tensor = dict(size=world, mode="sequence", ring_attention=variant)
        config = dict(parallel=dict(tensor=tensor))
    else:
        config = {}
    ctx = gt.launch(config, rank, world, "127.0.0.1", port)
    _WORLD = ctx.group(ParallelMode.GLOBAL)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.hidden, args.heads, variant) for _ in range(args.layers)))
    model.to(ctx.device)
    rows, seq = [], args.min_seq
    while seq <= args.max_seq:
        try:
            saved, peak = _one_step(model, args.batch, seq // world, args.hidden, ctx.device)
        except torch.OutOfMemoryError:
            saved, peak = -1, -1
        # a rank's number is the largest over ranks (they are equal up to the ring's order)
        t = torch.tensor([saved, peak], dtype=torch.float64, device=ctx.device)
        t = comm.all_reduce_max(t, ctx.group(ParallelMode.GLOBAL))
        saved, peak = int(t[0]), int(t[1])
        rows.append((seq, saved, peak))
        used = peak if ctx.device.type == "cuda" else saved
        if saved < 0 or used > args.budget_mb * 2**20:
            break
        seq *= 2
    if rank == 0:
        out.put((variant, world, rows))
    gt.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, variant: str, args) -> list[tuple[int, int, int]]:
    ctx = rank_context()
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, args, variant, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    variant_, world_, rows = out.get(timeout=args.timeout)
    for p in procs:
        p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--min-seq", type=int, default=256)
    parser.add_argument("--max-seq", type=int, default=4096)
    parser.add_argument("--budget-mb", type=float, default=16.0, help="activation budget per rank")
    parser.add_argument("--sizes", default="2,4", help="sequence-parallel sizes to run")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layouts = [(1, "dense-sdpa"), (1, "dense-math"), (1, "dense-online")]
    for n in (int(x) for x in args.sizes.split(",")):
        if device == "cuda" and n > torch.cuda.device_count():
            continue
        layouts += [(n, "standard"), (n, "online")]
    results = {(n, v): run(n, v, args) for n, v in layouts}
    seqs = sorted({s for rows in results.values() for s, _, _ in rows})
    mib = 2**20
    print(
        f"\nsequence-parallel activation memory per rank ({device}; hidden {args.hidden}, "
        f"heads {args.heads}, layers {args.layers}, batch {args.batch}; MiB saved for backward"
        + (", peak allocated" if device == "cuda" else "")
        + f"; budget {args.budget_mb:g} MiB)"
    )
    header = (
        f"{'layout':<22}" + "".join(f"{'S=' + str(s):>16}" for s in seqs) + f"{'longest S':>12}"
    )
    print(header)
    print("-" * len(header))
    for (n, v), rows in results.items():
        by_seq = {s: (saved, peak) for s, saved, peak in rows}
        cells = []
        for s in seqs:
            if s not in by_seq:
                cells.append(f"{'':>16}")
            elif by_seq[s][0] < 0:
                cells.append(f"{'OOM':>16}")
            elif device == "cuda":
                cells.append(f"{by_seq[s][0] / mib:>8.1f}/{by_seq[s][1] / mib:<7.1f}")
            else:
                cells.append(f"{by_seq[s][0] / mib:>16.2f}")
        used = {s: (p if device == "cuda" else sv) for s, sv, p in rows}
        fits = [s for s, u in used.items() if 0 <= u <= args.budget_mb * mib]
        longest = (
            f">={max(fits)}" if fits and max(fits) == max(used) else (max(fits) if fits else 0)
        )
        name = v if n == 1 else f"seq {n} {v}"
        print(f"{name:<22}" + "".join(cells) + f"{longest!s:>12}")


if __name__ == "__main__":
    main()
