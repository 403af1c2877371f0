"""The parity core: a dense reference run and an engine run of one model, through the public API.

* ``reference_run``: plain PyTorch in one process, no gridtrain: losses and the state dict
  after every optimizer step (index 0: before the first).
* ``data_rows``: this data-parallel rank's rows of a global batch, as
  ``gt.data.get_dataloader`` would hand them (the engine splits for the tensor mode itself).
* ``engine_step``: one optimizer step in any layout: the README's loop, or
  ``execute_schedule`` under pipeline parallelism; ``gradient_accumulation`` micro-steps.
  It touches no gradient and no parameter, so it cannot hang under ZeRO 3.
* ``global_loss``: the global batch's loss from every rank's report.
* ``param_share`` / ``state_share``: the fraction of the dense parameters, and of AdamW's
  dense state, that this rank holds, so a test fails when nothing was parallelised.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import gridtrain as gt

PM = gt.ParallelMode


def reference_run(
    build: Callable[[], nn.Module],
    batches: list,
    loss_fn: Callable,
    make_opt: Callable[[nn.Module], tuple],
) -> tuple[list[float], list[dict[str, Tensor]]]:
    """Losses and state dicts (``states[k]``: after ``k`` steps) of one plain process.
    ``make_opt(model)`` returns ``(optimizer, lr scheduler or None)``; the scheduler steps
    after every optimizer step, as the engine steps one given to ``gt.initialize``."""
    model = build()
    opt, sched = make_opt(model)
    states = [_copy(model.state_dict())]
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        states.append(_copy(model.state_dict()))
    return losses, states


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _rows(t, n: int, i: int):
    if isinstance(t, dict):
        return {k: _rows(v, n, i) for k, v in t.items()}
    return t.chunk(n)[i]


def data_rows(batch, ctx):
    """This data-parallel rank's contiguous rows of every tensor of a global batch."""
    n, i = ctx.world_size(PM.DATA), ctx.local_rank(PM.DATA)
    return tuple(_rows(t, n, i) for t in batch)


def engine_step(engine, x, y, ctx) -> float | None:
    """One optimizer step on this rank's batch ``(x, y)``; the mean loss of its micro-steps
    where this rank sees the loss (None on a pipeline stage without the head)."""
    accumulation = ctx.config.gradient_accumulation
    pipeline = ctx.world_size(PM.PIPELINE) > 1
    engine.train()
    engine.zero_grad()
    losses = []
    for xm, ym in zip(_chunks(x, accumulation), _chunks(y, accumulation), strict=True):
        if pipeline:
            _, _, loss = engine.execute_schedule(iter([(xm, ym)]), return_output_label=False)
        else:
            loss = engine.criterion(engine(xm), ym)
            engine.backward(loss)
        if loss is not None:
            losses.append(loss.item())
    engine.step()
    return sum(losses) / len(losses) if losses else None


def _chunks(t, n: int) -> list:
    if isinstance(t, dict):
        parts = {k: v.chunk(n) for k, v in t.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return list(t.chunk(n))


def global_loss(per_rank: list[float | None]) -> float:
    """The global batch's loss: the mean over ranks that report one. Every data-parallel
    rank reports the mean over its equal share of the batch, each as often as the others
    (once per tensor rank of its last pipeline stage)."""
    seen = [v for v in per_rank if v is not None]
    return sum(seen) / len(seen)


def local_numel(t: Tensor) -> int:
    """Elements this rank stores of ``t`` (a DTensor's local shard)."""
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def param_share(engine, dense_numel: int) -> float:
    """Parameter elements this rank holds over those of the dense model."""
    return sum(local_numel(p) for p in engine.model.parameters()) / dense_numel


def state_share(engine, dense_numel: int, per_param: int = 2) -> float:
    """Optimizer-state elements this rank holds over the dense model's ``per_param`` moments
    per parameter (AdamW: 2); scalar entries (step counts) not counted."""
    held = sum(
        local_numel(v)
        for state in engine.optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )
    return held / (per_param * dense_numel)
