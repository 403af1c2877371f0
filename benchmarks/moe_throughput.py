"""MoE against dense: training tokens/s of a mixture-of-experts model and of the same network
with a dense MLP of the same *active* width (top_k x ffn), so both do about the same FLOPs
per token. Two models (``--model``):

* ``widenet``: the WideNet ViT-MoE written with ``gt.nn``'s ``MoeLayer`` (below);
* ``mixtral``: a Hugging Face ``MixtralForCausalLM`` (8 experts, top 2, built from its config,
  no download) against ``MistralForCausalLM`` with ``intermediate_size = top_k x`` the
  experts' (``benchmarks/moe_hf.py``): plain PyTorch loops and ``gt.initialize`` at
  ``moe.expert_parallel_size`` 1 in the same run, the whole models in bf16.

    python benchmarks/moe_throughput.py                 # widenet: CPU always, plus CUDA
    python benchmarks/moe_throughput.py --device cpu --steps 3 --hidden 64 --depth 2
    python benchmarks/moe_throughput.py --device cuda --matmul grouped_mm bmm
    python benchmarks/moe_throughput.py --device cuda --compile
    python benchmarks/moe_throughput.py --model mixtral --device cuda

One process, all experts local (expert parallelism 1): what it measures is the
cost of routing, dispatch/combine and the expert matmuls, for each MoE dispatch:
``grouped`` (tokens sorted by expert, ``torch._grouped_mm`` or a padded batched
matmul, ``--matmul``) and ``capacity`` (``[experts, capacity]`` slots, the original
path). CUDA runs under bf16 autocast. Each model warms up, then trains ``--steps``
AdamW steps for ``--rounds`` rounds, the models taking turns; each keeps its best
round. Prints one table row per (device, model); ``dropped`` is the fraction of
token choices past capacity in the last step (the same for both dispatches).
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
from gridtrain.parallel.moe import expert_load  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("widenet", "mixtral"), default="widenet")
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    parser.add_argument("--seq", type=int, default=None, help="mixtral: tokens per sequence")
    parser.add_argument("--batch", type=int, default=None, help="images per step")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dispatch", nargs="+", choices=("grouped", "capacity"), default=["grouped", "capacity"]
    )
    parser.add_argument(
        "--matmul",
        nargs="+",
        choices=("auto", "grouped_mm", "bmm"),
        default=["auto"],
        help="grouped dispatch's expert matmul (auto: grouped_mm on Hopper bf16, else bmm)",
    )
    parser.add_argument("--no-drop", action="store_true", help="drop_tks=False")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile every model (MoE and dense alike)"
    )
    return parser.parse_args(argv)


def _sizes(args, device: str) -> dict:
    gpu = device == "cuda"
    return dict(
        # 512 images (33k tokens) on a GPU: at 256 the MoE step is bound by kernel launches
        # on the host, and the ratio swings with it (0.36-0.58 on one H200)
        batch=args.batch or (512 if gpu else 16),
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


def _variants(args) -> list[tuple[str, str | None, str | None]]:
    """(row name, dispatch, matmul) of every model to time; the dense model last."""
    out = []
    for dispatch in args.dispatch:
        matmuls = args.matmul if dispatch == "grouped" else [None]
        for matmul in matmuls:
            name = dispatch if dispatch == "capacity" else f"grouped/{matmul}"
            out.append((name, dispatch, matmul))
    return out + [("dense", None, None)]


def bench(device: str, args) -> list[tuple]:
    s = _sizes(args, device)
    cfg = WideNetConfig(
        depth=s["depth"],
        hidden=s["hidden"],
        heads=max(1, s["hidden"] // 64),
        ffn=2 * s["hidden"],
        num_experts=args.experts,
        top_k=args.top_k,
        drop_tks=not args.no_drop,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s["batch"], 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (s["batch"],), generator=g).to(device)
    tokens = s["batch"] * (1 + (cfg.img_size // cfg.patch_size) ** 2) * s["steps"]
    runs = {}
    for name, dispatch, matmul in _variants(args):
        torch.manual_seed(0)
        model = (WideNet if dispatch else DenseViT)(cfg).to(device)
        if dispatch:
            model.moe.dispatch = dispatch
            model.moe.experts.matmul = matmul or "auto"
        crit = MoeCriterion(model) if dispatch else torch.nn.CrossEntropyLoss()
        if args.compile:  # the module compiled in place: the criterion still reads its layers
            model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _round(model, crit, opt, x, y, 1, device)  # warm-up
        runs[name] = (model, crit, opt, [])
    for _ in range(args.rounds):
        for model, crit, opt, times in runs.values():
            times.append(_round(model, crit, opt, x, y, s["steps"], device))
    rows = []
    for name, (model, _, _, times) in runs.items():
        moe = name != "dense"
        total = sum(p.numel() for p in model.parameters())
        active = _active_params(model, cfg, moe)
        dropped = None
        if moe:
            load, drops = expert_load(model)
            dropped = drops / max(float(load.sum()), 1.0)
        rows.append((device, name, total, active, tokens / min(times), dropped))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model == "mixtral":
        from benchmarks.moe_hf import run_mixtral

        return run_mixtral(args)
    devices = ["cpu"] if args.device in ("all", "cpu") else []
    if args.device in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            raise SystemExit("--device cuda: CUDA is not available")
    rows = [row for d in devices for row in bench(d, args)]
    head = f"{'device':<7}{'model':<20}{'params':>12}{'active':>12}{'tokens/s':>14}{'vs dense':>10}"
    print(head + f"{'dropped':>9}")
    dense = {r[0]: r[4] for r in rows if r[1] == "dense"}
    for device, name, total, active, tps, dropped in rows:
        ratio = tps / dense[device]
        drop = "" if dropped is None else f"{dropped:>9.3f}"
        print(f"{device:<7}{name:<20}{total:>12,}{active:>12,}{tps:>14,.0f}{ratio:>10.2f}{drop}")


if __name__ == "__main__":
    main()
