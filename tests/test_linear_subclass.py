"""A subclass of ``nn.Linear`` with a forward of its own is the user's layer, not a Linear:
the planner keeps it whole (its forward runs) unless that forward computes ``F.linear``,
and parallelises the rest. A LoRA-style layer (an extra low-rank path through two child
Linears) and a scaled head train under 1d equal to one process; the plain Linears around
them are really split. Hugging Face's ``Conv1D`` (weight ``[in, out]``) in a plain model is a
Linear to the planner, as in a ``transformers`` model (``gridtrain.hf`` registers it)."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import engine_run, global_losses, reference_run, seeded
from torch import nn

WIDTH, STEPS = 16, 3


class LoRALinear(nn.Linear):
    """``x W^T + b + B(A(x))``: fine-tuning's low-rank adapter beside a frozen-style weight."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4):
        super().__init__(n_in, n_out)
        self.lora_a = nn.Linear(n_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, n_out, bias=False)

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x))


class ScaledLinear(nn.Linear):
    """A head whose forward scales its output (as some models scale logits)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


class SameLinear(nn.Linear):
    """Its own forward, computing exactly ``F.linear``: still a Linear to the planner."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


def _conv1d(n_in: int, n_out: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(n_out, n_in)


def build(kind: str) -> nn.Module:
    custom = {"lora": LoRALinear, "scaled": ScaledLinear, "same": SameLinear, "conv1d": _conv1d}
    return nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), custom[kind](WIDTH, 8)
    )


def batches():
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(4, WIDTH, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    return [(b, torch.randint(0, 8, (4,), generator=gen)) for b in x]


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(ctx, kind):
    return engine_run(ctx, lambda: seeded(lambda: build(kind)), batches(), loss_fn, adamw)


CONFIG = dict(parallel=dict(tensor=dict(size=2, mode="1d")))


@pytest.mark.parametrize(
    "kind, head_share",
    [
        ("lora", 1.0),
        ("scaled", 1.0),
        ("same", pytest.approx(0.5, abs=0.1)),
        ("conv1d", pytest.approx(0.5, abs=0.1)),  # a plain model's Conv1D is split too
    ],
)
def test_a_linear_subclass_keeps_its_forward_under_1d(kind, head_share):
    ref = reference_run(lambda: seeded(lambda: build(kind)), batches(), loss_fn, adamw)
    runs = run_distributed(_train, 2, kind, config=CONFIG)
    losses = torch.tensor(global_losses(runs), dtype=torch.float64)
    # float64: a split Linear only reorders sums (measured <= 1e-15); a dropped extra path or
    # scale moves the loss by O(1e-1)
    torch.testing.assert_close(
        losses, torch.tensor(ref.losses, dtype=torch.float64), rtol=1e-10, atol=1e-12
    )
    for run in runs:
        for key, value in ref.state.items():
            torch.testing.assert_close(run.state[key], value, rtol=1e-8, atol=1e-10, msg=key)
        assert run.shares["0.weight"] == pytest.approx(0.5), run.shares  # the MLP is split
        assert run.shares["3.weight"] == head_share, (kind, run.shares)  # the custom layer
