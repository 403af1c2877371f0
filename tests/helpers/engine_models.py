"""Tiny models and dense references shared by the engine tests (test_engine_dp, _clip, _amp, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gridtrain as gt
from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import set_shard_spec

D_IN, HIDDEN, D_OUT = 8, 16, 4


class MLP(nn.Module):
    """The dense model every test compares against."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class ShardedMLP(nn.Module):
    """The same MLP split Megatron-style over TENSOR by hand (fc1 by column, fc2 by row).

    Parameter names equal MLP's, so full state dicts and checkpoints move between them.
    """

    def __init__(self, ctx):
        super().__init__()
        t = ctx.world_size(ParallelMode.TENSOR)
        self.group = ctx.group(ParallelMode.TENSOR)
        self.fc1 = nn.Linear(D_IN, HIDDEN // t)
        self.fc2 = nn.Linear(HIDDEN // t, D_OUT)
        set_shard_spec(self.fc1.weight, (0, ParallelMode.TENSOR))
        set_shard_spec(self.fc1.bias, (0, ParallelMode.TENSOR))
        set_shard_spec(self.fc2.weight, (1, ParallelMode.TENSOR))

    def forward(self, x):
        h = F.relu(self.fc1(comm.copy_to_group(x, self.group)))
        return comm.reduce_from_group(F.linear(h, self.fc2.weight), self.group) + self.fc2.bias


def dense_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in MLP().state_dict().items()}


def sharded_model(ctx, state) -> ShardedMLP:
    model = ShardedMLP(ctx)
    gt.load_full_state_dict(model, state, ctx)
    return model


def global_batches(
    steps: int, batch: int, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, D_IN, generator=g), torch.randn(batch, D_OUT, generator=g))
        for _ in range(steps)
    ]


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def dense_train(state, batches, make_opt, clip: float = 0.0, make_sched=None):
    """Single-process reference: (final state, losses, grad norms before clipping)."""
    model = MLP()
    model.load_state_dict(state)
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses, norms


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
