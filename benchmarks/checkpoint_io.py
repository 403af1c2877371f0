"""Checkpoint I/O: save and load seconds and peak memory per rank, dense file vs sharded (DCP).

    python benchmarks/checkpoint_io.py                  # GPT preset (~34M parameters), 1/2/4/8 ranks
    python benchmarks/checkpoint_io.py --quick          # CI size (~0.7M parameters), 1/2 ranks
    python benchmarks/checkpoint_io.py --ranks 1 4 --preset gpt-30m --dir /fast/disk

A GPT-like model (token and position embeddings, pre-norm blocks of separate q/k/v,
output and two MLP Linears, an untied head) in plain PyTorch is sharded by the engine
under tensor mode 1d over all N ranks (gloo, CPU), AdamW state is allocated, then each
format is saved and loaded back by every rank:

* ``dense``: ``save_checkpoint(sharded=False)``: the full model and optimizer state are
  gathered on every rank and rank 0 writes one file; every rank reads the whole file;
* ``sharded``: every rank writes and reads only its own shards (DCP);
* ``async``: sharded, ``async_save=True``: ``stall`` is how long ``save_checkpoint``
  blocked (a CPU copy of this rank's state), ``save`` how long until the checkpoint was
  complete on disk.

Times are the slowest rank's, between barriers. Memory is resident set size: ``base``
before saving (model + optimizer + runtime), ``save``/``load``: the peak during that
phase (``VmHWM`` reset through ``/proc/self/clear_refs``; else a 5 ms sampler). Loads read
what was just written, so from the page cache: they measure the format's own cost, not the
disk. On few cores many ranks contend for the same CPUs; compare rows of one ranks count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rank_procs import rank_context  # the sibling module (benchmarks/ is sys.path[0])
from torch import nn

PRESETS = {
    "gpt-30m": dict(vocab=8192, hidden=512, layers=8, heads=8, seq=64),
    "quick": dict(vocab=1024, hidden=128, layers=2, heads=8, seq=16),
}
FORMATS = ("dense", "sharded", "async")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads  # from the configuration: under 1d q/k/v are split
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            t.reshape(b, s, -1, self.head_dim).transpose(1, 2)
            for t in (self.q(h), self.k(h), self.v(h))
        )
        a = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, s, -1)
        )
        x = x + self.out(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---- memory --------------------------------------------------------------------------------
def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Peak:
    """Peak resident memory (MB) inside the block."""

    def __enter__(self):
        self.peak = _rss_mb()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self._thread = None
        except OSError:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        if self._thread is None:
            self.peak = max(self.peak, _rss_mb("VmHWM"))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_mb())


def _disk_mb(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


# ---- one world size ------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, fmt: str, preset: dict, out_dir: str, results):
    import gridtrain as gt
    from gridtrain.engine.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    config = dict(parallel=dict(tensor=dict(size=world, mode="1d"))) if world > 1 else {}
    gt.launch(config, rank, world, "127.0.0.1", port, backend="gloo")
    torch.manual_seed(0)
    model = GPT(**preset)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    example = torch.zeros(2, preset["seq"], dtype=torch.long)
    engine, *_ = gt.initialize(model, opt, example_inputs=example)
    model, opt = engine.model, engine.optimizer
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # allocates Adam's moments
    opt.zero_grad(set_to_none=True)
    path = Path(out_dir) / (f"{world}_{fmt}" + (".pt" if fmt == "dense" else ""))
    gc.collect()
    dist.barrier()
    base = _rss_mb()
    with Peak() as save_peak:
        start = time.perf_counter()
        handle = save_checkpoint(
            path, 1, model, opt, sharded=fmt != "dense", async_save=fmt == "async"
        )
        stall = time.perf_counter() - start
        if handle is not None:
            handle.wait()
        dist.barrier()
        save_s = time.perf_counter() - start
    gc.collect()
    dist.barrier()
    with Peak() as load_peak:
        start = time.perf_counter()
        load_checkpoint(path, model, opt)
        dist.barrier()
        load_s = time.perf_counter() - start
    row = dict(save=save_s, stall=stall, load=load_s, base=base, save_peak=save_peak.peak,
               load_peak=load_peak.peak, disk=_disk_mb(path) if rank == 0 else 0.0)  # fmt: skip
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        merged = {k: max(r[k] for r in gathered) for k in row}
        merged.update(ranks=world, fmt=fmt, params=params)
        merged["stall"] = merged["stall"] if fmt == "async" else None
        results.put(merged)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    gt.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ranks: list[int], preset: dict, out_dir: str) -> list[dict]:
    """One fresh set of processes per (ranks, format): each starts from the same memory."""
    rows = []
    ctx = rank_context()
    for world in ranks:
        for fmt in FORMATS:
            results = ctx.SimpleQueue()
            args = (world, _free_port(), fmt, preset, out_dir, results)
            mp.start_processes(_rank, args=args, nprocs=world, start_method=ctx.get_start_method())
            rows.append(results.get())
    return rows


def table(rows: list[dict]) -> str:
    head = "| ranks | format | save s | stall s | load s | base MB/rank | save peak MB/rank | load peak MB/rank | on disk MB |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        stall = f"{r['stall']:.2f}" if r["stall"] is not None else ""
        lines.append(
            f"| {r['ranks']} | {r['fmt']} | {r['save']:.2f} | {stall} | {r['load']:.2f} | "
            f"{r['base']:.0f} | {r['save_peak']:.0f} | {r['load_peak']:.0f} | {r['disk']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt-30m")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="default 1 2 4 8")
    parser.add_argument("--quick", action="store_true", help="CI size: preset quick, ranks 1 2")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else args.preset]
    ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4, 8])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out_dir = args.dir or tempfile.mkdtemp(prefix="gt-ckpt-bench-")
    try:
        rows = run(ranks, preset, out_dir)
    finally:
        if args.dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    params = rows[0]["params"]
    print(f"checkpoint I/O, {params / 1e6:.1f}M parameters + AdamW state, tensor 1d over all ranks, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")  # fmt: skip
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
