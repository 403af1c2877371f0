"""A tiny model and per-rank training functions shared by the checkpoint tests.

The model is written once with ``gt.nn`` (so every tensor mode builds its own
layers) as an ``nn.Sequential`` (so a pipeline can cut it); every rank starts
from the same dense state dict, and one optimizer step is one
``execute_schedule`` over the whole global batch, in any layout.
"""

from __future__ import annotations

import torch
from torch import nn

import gridtrain as gt
import gridtrain.nn as gnn
from gridtrain.engine.checkpoint import load_checkpoint, save_checkpoint
from gridtrain.engine.checkpoint.dense import dense_optimizer_state
from gridtrain.parallel.context import get_context, has_context, set_context

D_IN, N_CLASSES, BATCH = 16, 8, 8


def tiny_net(hidden: int = 32, dropout: float = 0.0) -> nn.Sequential:
    """Linear, GELU, (Dropout), Linear, LayerNorm, Classifier: every parameter kind of a block."""
    layers: list[nn.Module] = [gnn.Linear(D_IN, hidden), nn.GELU()]
    if dropout:
        layers.append(gnn.Dropout(dropout))
    layers += [gnn.Linear(hidden, D_IN), gnn.LayerNorm(D_IN), gnn.Classifier(D_IN, N_CLASSES)]
    return nn.Sequential(*layers)


def dense_state(seed: int = 0, hidden: int = 32, dropout: float = 0.0) -> dict[str, torch.Tensor]:
    """The dense model's state dict (built with no context, whatever is current)."""
    saved = get_context() if has_context() else None
    set_context(None)
    try:
        torch.manual_seed(seed)
        return {k: v.clone() for k, v in tiny_net(hidden, dropout).state_dict().items()}
    finally:
        set_context(saved)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, D_IN, generator=g), torch.randint(N_CLASSES, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def build(ctx, state=None, hidden: int = 32, dropout: float = 0.0, lr: float = 1e-2):
    """Engine with AdamW and an LR scheduler, weights from ``state`` (else a seed-7 init)."""
    torch.manual_seed(7)
    model = tiny_net(hidden, dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    example = torch.zeros(BATCH, D_IN)  # the engine traces the data flow to plan the splits
    engine, *_ = gt.initialize(
        model, opt, gnn.CrossEntropyLoss(), lr_scheduler=sched, example_inputs=example
    )
    if state is not None:
        gt.load_full_state_dict(engine.model, state, ctx)
    engine.train()
    return engine, sched


def step(engine, x, y) -> float | None:
    """One optimizer step on the global batch; the loss where this rank sees it (else None)."""
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(iter([(x, y)]), return_output_label=False)
    engine.step()
    return None if loss is None else loss.item()


def train_and_save(ctx, state, data, path, sharded=True, async_save=False):
    """Train on ``data`` and save; returns the losses."""
    engine, sched = build(ctx, state)
    losses = [step(engine, x, y) for x, y in data]
    handle = save_checkpoint(
        path, len(data), engine.model, engine.optimizer, sched, sharded, async_save
    )
    if handle is not None:
        handle.wait()
    return losses


def load_and_continue(ctx, path, data):
    """Load into a fresh model (another init), then train on ``data``: (epoch, losses, dense
    state after loading, dense optimizer state after loading, dense state at the end, lr)."""
    engine, sched = build(ctx)
    epoch = load_checkpoint(path, engine.model, engine.optimizer, sched)
    loaded = gt.full_state_dict(engine.model, ctx)
    loaded_opt = dense_optimizer_state(engine.optimizer, engine.model, ctx)["state"]
    lr = engine.optimizer.param_groups[0]["lr"]
    losses = [step(engine, x, y) for x, y in data]
    return epoch, losses, loaded, loaded_opt, gt.full_state_dict(engine.model, ctx), lr


def dense_run(ctx, state, data):
    """The single-process reference: losses, dense states and optimizer state after each step."""
    engine, _ = build(ctx, state)
    out = []
    for x, y in data:
        loss = step(engine, x, y)
        out.append(
            (
                loss,
                gt.full_state_dict(engine.model, ctx),
                dense_optimizer_state(engine.optimizer, engine.model, ctx)["state"],
            )
        )
    return out
