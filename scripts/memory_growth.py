"""Resident memory of a long pipeline x tensor run, per rank, with Python allocation growth.

    gridtrain run --nproc_per_node 4 --config demos/gpt/configs/tp2_pp2.py \
        scripts/memory_growth.py --steps 2000 --every 100

Trains the GPT demo model (tiny preset) like demos/gpt/train.py and prints, every
``--every`` steps, each rank's RSS (from /proc) and the Python allocations that grew most
since the previous report (tracemalloc), so growth can be told apart from allocator
arenas settling: Python objects that accumulate show up by file and line; RSS growth with
flat Python allocations is the C allocator (glibc arenas) or torch's own caches.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gridtrain as gt  # noqa: E402
from demos.gpt import data as gpt_data  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    ctx = gt.launch_from_torch()
    tokens, _ = gpt_data.split_corpus(gpt_data.load_corpus(None))
    cfg = gpt_model.preset("tiny", vocab_size=gpt_data.VOCAB_SIZE, block_size=args.seq_len)
    model = gpt_model.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = ctx.data_parallel_size
    dl = gt.data.get_dataloader(
        gpt_data.WindowDataset(tokens, args.seq_len), args.batch_size // dp, shuffle=True
    )
    engine, dl, _, _ = gt.initialize(model, opt, gpt_model.GPTLoss(), dl)
    tracemalloc.start(10)
    snap, last_rss, first_rss = None, None, None
    it = iter(dl)
    for step in range(1, args.steps + 1):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(dl)
            batch = next(it)
        engine.zero_grad()
        engine.execute_schedule(iter([batch]), return_output_label=False)
        engine.step()
        if step % args.every == 0:
            gc.collect()
            rss, now = rss_mb(), tracemalloc.take_snapshot()
            first_rss = rss if first_rss is None else first_rss
            grew = ""
            if snap is not None:
                top = now.compare_to(snap, "lineno")[:3]
                grew = "; ".join(f"{s.traceback[0].filename.split('/')[-1]}:"
                                 f"{s.traceback[0].lineno} {s.size_diff / 1024:+.0f} KiB"
                                 for s in top)  # fmt: skip
            py = sum(s.size for s in now.statistics("filename")) / 2**20
            delta = "" if last_rss is None else f"{rss - last_rss:+.2f}"
            print(f"rank {ctx.global_rank} step {step}: RSS {rss:.1f} MB ({delta}), "
                  f"python {py:.2f} MB; grew: {grew}", flush=True)  # fmt: skip
            snap, last_rss = now, rss
    gt.destroy()


if __name__ == "__main__":
    main()
