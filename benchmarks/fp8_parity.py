"""fp8 against bf16: the same GPT trained for a few hundred steps each way, loss curves side by side.

    python benchmarks/fp8_parity.py                  # H200: GPT-2 124M, seq 1024, 300 steps
    python benchmarks/fp8_parity.py --device cpu     # tiny preset, short run
    python benchmarks/fp8_parity.py --device cpu --eager --steps 6  # CI form: no compile

Both runs go through the engine with the same seed, weights and batches (byte-level
text from ``demos/gpt``'s embedded corpus, so the loss has somewhere to go): one in
``fp16 = dict(mode=bf16)``, one adding ``fp8 = True`` (torchao float8 in the block
Linears). The table gives the mean loss over windows of steps, the gap, and each
run's tokens/s; ``--plot`` writes the two curves as a PNG.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt_throughput as gb  # noqa: E402
from demos.gpt import data as gpt_data  # noqa: E402
from demos.gpt import model as gpt_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--preset", default=None, help="default small (cpu tiny)")
    p.add_argument("--steps", type=int, default=None, help="default 300 (cpu 30)")
    p.add_argument("--batch-size", type=int, default=None, help="default 8 (cpu 8)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu 64)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--window", type=int, default=None, help="steps per table row (steps/6)")
    p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    p.add_argument(
        "--eager",
        action="store_true",
        help="no torch.compile in either run (the CI form: inductor's first compile on a CPU "
        "costs a minute; the measured runs compile)",
    )
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    a.device = "cuda" if cuda else "cpu"
    a.preset = a.preset or ("small" if cuda else "tiny")
    a.steps = a.steps or (300 if cuda else 30)
    a.batch_size = a.batch_size or 8
    a.seq_len = a.seq_len or (1024 if cuda else 64)
    a.window = a.window or max(1, a.steps // 6)
    return a


def batches(a) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = gpt_data.split_corpus(gpt_data.load_corpus())
    windows = gpt_data.WindowDataset(train, a.seq_len)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(windows), generator=g)
    out = []
    for step in range(a.steps):
        idx = [int(order[(step * a.batch_size + i) % len(order)]) for i in range(a.batch_size)]
        xs, ys = zip(*(windows[i] for i in idx), strict=True)
        out.append((torch.stack(xs).to(a.device), torch.stack(ys).to(a.device)))
    return out


def run(name: str, extra: dict, a, cfg, data) -> tuple[list[float], float]:
    """Per-step losses and tokens/s (after the first 5 steps) of one engine run."""
    flags = [] if a.eager else ["--compile"]
    args = gb.parse_args(["--device", a.device, *flags, "--seq-len", str(a.seq_len)])
    torch.manual_seed(0)
    loop = gb.EngineLoop(cfg, args, a.device, extra=extra)
    for group in loop.engine.optimizer.param_groups:
        group["lr"] = a.lr
    engine, losses = loop.engine, []
    start = None
    for step, batch in enumerate(data):
        if step == 5:
            gb.sync(a.device)
            start = time.perf_counter()
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([batch]), return_output_label=False)
        engine.step()
        losses.append(loss.detach())
        if (step + 1) % max(1, a.steps // 10) == 0:
            print(f"  {name}: step {step + 1}/{a.steps}, loss {loss.item():.4f}", flush=True)
    gb.sync(a.device)
    timed = max(1, a.steps - 5)
    tok_s = timed * a.batch_size * a.seq_len / (time.perf_counter() - start) if start else 0.0
    return [float(x) for x in losses], tok_s


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(2)
    backend = "gloo" if a.device == "cpu" else None
    gb.gt.launch(dict(fp16=dict(mode="bf16")), 0, 1, "127.0.0.1", gb.free_port(), backend=backend)
    cfg = gpt_model.preset(a.preset, block_size=max(a.seq_len, 64))
    data = batches(a)
    compiled = {} if a.eager else dict(compile=True)
    extras = {"bf16": dict(compiled), "bf16 + fp8": dict(compiled, fp8=True)}
    if a.device == "cpu":  # the tiny preset's Linears are narrower than fp8's default 256
        extras["bf16 + fp8"]["fp8"] = dict(min_features=16)
    curves, speed = {}, {}
    for name, extra in extras.items():
        curves[name], speed[name] = run(name, extra, a, cfg, data)
    gb.gt.destroy()
    print_table(curves, speed, a)
    if a.plot:
        plot(curves, a)
    return dict(curves=curves, speed=speed)


def print_table(curves: dict, speed: dict, a) -> None:
    ref, fp8 = curves["bf16"], curves["bf16 + fp8"]
    print(
        f"\nfp8 vs bf16: GPT {a.preset}, seq {a.seq_len}, batch {a.batch_size}, {a.steps} steps, "
        f"lr {a.lr:g}, {a.device}"
    )
    head = f"{'steps':>11} {'bf16 loss':>10} {'fp8 loss':>10} {'gap':>8}"
    print(head + "\n" + "-" * len(head))
    for lo in range(0, a.steps, a.window):
        hi = min(a.steps, lo + a.window)
        r, f = sum(ref[lo:hi]) / (hi - lo), sum(fp8[lo:hi]) / (hi - lo)
        print(f"{lo + 1:>5}-{hi:<5} {r:>10.4f} {f:>10.4f} {f - r:>+8.4f}")
    print(
        f"tokens/s: bf16 {speed['bf16']:,.0f}, bf16 + fp8 {speed['bf16 + fp8']:,.0f} "
        f"(fp8/bf16 {speed['bf16 + fp8'] / max(speed['bf16'], 1e-9):.3f})"
    )


def plot(curves: dict, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set(xlabel="step", ylabel="loss", title=f"GPT {a.preset}: fp8 vs bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
