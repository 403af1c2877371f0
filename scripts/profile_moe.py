"""Where a WideNet MoE training step's time goes on the GPU, against the dense model.

    python scripts/profile_moe.py [--hidden 512] [--batch 256] [--depth 8] [--compile]

Uses ``benchmarks/moe_throughput.py``'s models and sizes; prints, per model, the wall and
GPU-busy time per step, host syncs, and the kernels that take the most time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demos.moe.model import DenseViT, MoeCriterion, WideNet, WideNetConfig  # noqa: E402
from scripts.profile_step import report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    a = p.parse_args()
    cfg = WideNetConfig(depth=a.depth, hidden=a.hidden, heads=a.hidden // 64, ffn=2 * a.hidden,
                        num_experts=8, top_k=2, drop_tks=True)  # fmt: skip
    x = torch.randn(a.batch, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (a.batch,), device="cuda")
    for name, cls in (("moe grouped", WideNet), ("dense", DenseViT)):
        torch.manual_seed(0)
        model = cls(cfg).cuda()
        crit = MoeCriterion(model) if cls is WideNet else torch.nn.CrossEntropyLoss()
        if a.compile:
            model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(_batch, model=model, crit=crit, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16):
                loss = crit(model(x), y)
            loss.backward()
            opt.step()

        report(name, step, [None], a.steps)


if __name__ == "__main__":
    main()
