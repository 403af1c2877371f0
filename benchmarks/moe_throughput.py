"""MoE against dense: training tokens/s of the WideNet ViT-MoE and of the same network with a
dense MLP of the same *active* width (top_k x ffn), so both do about the same FLOPs per token.

    python benchmarks/moe_throughput.py                 # CPU always, plus CUDA when present
    python benchmarks/moe_throughput.py --device cpu --steps 3 --hidden 64 --depth 2

One process, all experts local (expert parallelism 1): what it measures is the
cost of routing, the dispatch/combine einsums and padding to capacity. CUDA runs
under bf16 autocast. Each model warms up, then trains ``--steps`` AdamW steps
for ``--rounds`` rounds alternating MoE and dense; each keeps its best round.
Prints one table row per (device, model).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demos.moe.model import DenseViT, MoeCriterion, WideNet, WideNetConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    parser.add_argument("--batch", type=int, default=None, help="images per step")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def _sizes(args, device: str) -> dict:
    gpu = device == "cuda"
    return dict(
        batch=args.batch or (256 if gpu else 16),
        hidden=args.hidden or (512 if gpu else 64),
        depth=args.depth or (8 if gpu else 2),
        steps=args.steps or (20 if gpu else 3),
    )


def _active_params(model, cfg: WideNetConfig, moe: bool) -> int:
    total = sum(p.numel() for p in model.parameters())
    if moe:  # only top_k of the experts run per token
        expert = sum(p.numel() for p in model.moe.experts.parameters())
        total -= expert - expert * cfg.top_k // cfg.num_experts
    return total


def _round(model, crit, opt, x, y, steps, device) -> float:
    amp = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(device: str, args) -> list[tuple]:
    s = _sizes(args, device)
    cfg = WideNetConfig(
        depth=s["depth"],
        hidden=s["hidden"],
        heads=max(1, s["hidden"] // 64),
        ffn=2 * s["hidden"],
        num_experts=args.experts,
        top_k=args.top_k,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s["batch"], 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (s["batch"],), generator=g).to(device)
    tokens = s["batch"] * (1 + (cfg.img_size // cfg.patch_size) ** 2) * s["steps"]
    runs = {}
    for name, cls in (("moe", WideNet), ("dense", DenseViT)):
        torch.manual_seed(0)
        model = cls(cfg).to(device)
        crit = MoeCriterion(model) if name == "moe" else torch.nn.CrossEntropyLoss()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _round(model, crit, opt, x, y, 1, device)  # warm-up
        runs[name] = (model, crit, opt, [])
    for _ in range(args.rounds):
        for model, crit, opt, times in runs.values():
            times.append(_round(model, crit, opt, x, y, s["steps"], device))
    rows = []
    for name, (model, _, _, times) in runs.items():
        total = sum(p.numel() for p in model.parameters())
        active = _active_params(model, cfg, name == "moe")
        rows.append((device, name, total, active, tokens / min(times)))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    devices = ["cpu"] if args.device in ("all", "cpu") else []
    if args.device in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            raise SystemExit("--device cuda: CUDA is not available")
    rows = [row for d in devices for row in bench(d, args)]
    print(f"{'device':<7}{'model':<7}{'params':>12}{'active':>12}{'tokens/s':>14}{'vs dense':>10}")
    dense = {r[0]: r[4] for r in rows if r[1] == "dense"}
    for device, name, total, active, tps in rows:
        ratio = tps / dense[device]
        print(f"{device:<7}{name:<7}{total:>12,}{active:>12,}{tps:>14,.0f}{ratio:>10.2f}")


if __name__ == "__main__":
    main()
