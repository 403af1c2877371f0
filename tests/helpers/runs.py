"""The one parity harness: a plain-PyTorch reference run and an engine run of the same model,
batches and optimizer, the engine driven and read through the public API only.

* ``batches`` / ``token_batches``: seeded global batches (one generator for every test).
* ``data_rows``: this data-parallel rank's rows of a global batch, as
  ``gt.data.get_dataloader`` would hand them (the engine splits for the tensor mode itself).
* ``reference_run``: one plain process, no gridtrain; ``engine_run``: the same through
  ``gt.initialize`` in any layout. Both return a ``Run``: losses, dense weights, the gradient
  each step applied; a ``start_engine`` for tests that drive the engine themselves.
* ``engine_step``: one optimizer step in any layout: the README's loop, or
  ``execute_schedule`` under pipeline parallelism; ``gradient_accumulation`` micro-steps;
  tensor or dict (Hugging Face) inputs.
* ``global_losses``: the global batch's loss per step from every rank's run;
  ``assert_grads_close``: an engine run's gradients against the reference's.
* ``shares`` / ``param_share`` / ``state_share`` / ``state_numel``: how much of the dense
  parameters (and of AdamW's dense state) this rank holds, so a test fails when nothing was
  parallelised.

Gradients are read back from the optimizer's moments (``gt.full_optimizer_state_dict``), on
both sides alike: every rank gathers every tensor in the same order (a gather that only some
ranks enter, or FSDP2's sharded ``p.grad`` sent out as it is, hangs under ZeRO 3), and the
engine's gradient is the one its optimizer really stepped with, in every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import gridtrain as gt

PM = gt.ParallelMode


# ---- batches -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Normal:
    """A standard-normal tensor of ``shape``."""

    shape: tuple[int, ...]


@dataclass(frozen=True)
class Ints:
    """Integers in ``[0, high)`` of ``shape`` (labels, token ids)."""

    high: int
    shape: tuple[int, ...]


def batches(steps: int, *draws: Normal | Ints, seed: int = 1) -> list[tuple[Tensor, ...]]:
    """``steps`` global batches from one seeded generator, one tensor per draw each."""
    g = torch.Generator().manual_seed(seed)

    def draw(d):
        if isinstance(d, Ints):
            return torch.randint(0, d.high, d.shape, generator=g)
        return torch.randn(*d.shape, generator=g)

    return [tuple(draw(d) for d in draws) for _ in range(steps)]


def token_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list:
    """``steps`` (token ids, next-token labels) pairs of ``batch`` x ``seq`` tokens."""
    out = []
    for (ids,) in batches(steps, Ints(vocab, (batch, seq + 1)), seed=seed):
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def lm_loss(logits, labels):
    """Next-token cross entropy through ``gt.nn.CrossEntropyLoss``: any layout's logits."""
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def dense_lm_loss(logits, labels):
    """The same loss in plain PyTorch, for the one-process reference."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def data_rows(batch, ctx):
    """This data-parallel rank's contiguous rows of a global batch: of a tensor, of every
    tensor of a dict, or of every item of a tuple."""
    if isinstance(batch, dict):
        return {k: data_rows(v, ctx) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return tuple(data_rows(t, ctx) for t in batch)
    return batch.chunk(ctx.world_size(PM.DATA))[ctx.local_rank(PM.DATA)]


# ---- runs --------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run.

    * ``losses[k]``: step k's loss where this rank sees it (else None);
    * ``grads[k]``: the gradient step k applied, by dense name (clipped, if clipping is on);
    * ``norms[k]``: the gradient's 2-norm before clipping (the engine's ``last_grad_norm``,
      None where it does not clip);
    * ``state``: the dense weights at the end; ``states[k]``: after k steps (the engine keeps
      ``states[0]`` only when asked, ``engine_run(initial=True)``: right after initialize).

    Reference only: ``aliases`` (a tied parameter's other names -> the name it is listed
    under), ``optim`` (the optimizer state at the end, in ``gt.full_optimizer_state_dict``'s
    form). Engine only: ``shares``, ``held`` (parameter elements this rank holds, a tied copy
    on another pipeline stage included), ``plan``, ``watched[k]`` (what ``watch(engine,
    outputs)`` returned after step k; ``outputs``: the step's model outputs, none under a
    pipeline) and ``probed`` (what ``probe(engine)`` returned after training).
    """

    losses: list[float | None]
    state: dict[str, Tensor]
    grads: list[dict[str, Tensor]]
    optim: dict[str, Any] = field(default_factory=dict)
    states: list[dict[str, Tensor]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)
    held: int = 0
    plan: str = ""
    watched: list = field(default_factory=list)
    probed: Any = None


def seeded(build: Callable[[], nn.Module], seed: int = 0, dtype=torch.float64) -> nn.Module:
    """``build()`` after ``torch.manual_seed(seed)``, in ``dtype`` (float64: layouts then
    differ only by summation order)."""
    torch.manual_seed(seed)
    return build().to(dtype)


def _optimizer(made) -> tuple:
    """``make_opt(model)`` returns an optimizer or (optimizer, LR scheduler or None)."""
    return made if isinstance(made, tuple) else (made, None)


def _call(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def reference_run(build, batches, loss_fn, make_opt, clip: float = 0.0, grad_steps: int = 1):
    """``build()`` trained on whole batches in one plain process: a ``Run`` with every
    step's weights; the scheduler, if any, steps after every optimizer step (as the engine
    steps one given to ``gt.initialize``)."""
    model = build()
    opt, sched = _optimizer(make_opt(model))
    run = Run([], {}, [], states=[_copy(model.state_dict())], aliases=_aliases(model))
    before = None
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(_call(model, x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        opt.step()
        if sched is not None:
            sched.step()
        run.losses.append(loss.item())
        run.norms.append(norm.item())
        run.states.append(_copy(model.state_dict()))
        run.optim = plain_optimizer_state(model, opt)
        if step < grad_steps:
            run.grads.append(stepped_grads(before, run.optim))
            before = run.optim
    run.state = run.states[-1]
    return run


def _aliases(model: nn.Module) -> dict[str, str]:
    first = {id(p): n for n, p in model.named_parameters()}
    every = model.named_parameters(remove_duplicate=False)
    return {n: first[id(p)] for n, p in every if first[id(p)] != n}


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def plain_optimizer_state(model: nn.Module, opt) -> dict[str, Any]:
    """A plain optimizer's state in ``gt.full_optimizer_state_dict``'s form."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"state": {}, "group_of": {}, "param_groups": []}
    for index, group in enumerate(opt.param_groups):
        out["param_groups"].append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            out["group_of"][names[id(p)]] = index
            if p in opt.state:
                out["state"][names[id(p)]] = {
                    k: v.detach().clone() if isinstance(v, Tensor) else v
                    for k, v in opt.state[p].items()
                }
    return out


def stepped_grads(before: dict | None, after: dict) -> dict[str, Tensor]:
    """The gradient of the step between two dense optimizer states (``before`` None: the
    first step), from the moment it updates: Adam's ``exp_avg = b1 m + (1 - b1) g``, SGD's
    ``momentum_buffer = mu b + g`` (weight decay, where SGD adds it, included on both sides
    of a comparison alike)."""
    grads = {}
    for name, entry in after["state"].items():
        hyper = after["param_groups"][after["group_of"][name]]
        prev = before["state"].get(name, {}) if before else {}
        if "exp_avg" in entry:
            b1 = hyper["betas"][0]
            m0 = prev.get("exp_avg", torch.zeros_like(entry["exp_avg"]))
            grads[name] = (entry["exp_avg"] - b1 * m0) / (1 - b1)
        elif "momentum_buffer" in entry:
            b0 = prev.get("momentum_buffer", torch.zeros_like(entry["momentum_buffer"]))
            grads[name] = entry["momentum_buffer"] - hyper["momentum"] * b0
        else:
            raise ValueError(f"{name}: no moment to read a gradient from in {sorted(entry)}")
    return grads


def engine_run(
    ctx,
    build,
    batches,
    loss_fn,
    make_opt,
    grad_steps=1,
    probe=None,
    watch=None,
    load=None,
    initial=False,
    **init_kw,
) -> Run:
    """``build()`` trained through ``gt.initialize(model, opt, loss_fn, **init_kw)`` on this
    data-parallel rank's rows of each batch: a ``Run`` with this rank's losses, the dense
    weights, the first ``grad_steps`` steps' gradients, this rank's
    ``shares`` and the printed plan. ``load``: a dense state given to
    ``gt.load_full_state_dict`` right after ``gt.initialize`` (a ``gt.lazy_init`` model has
    no weights before it). Collective: every rank gathers the same tensors."""
    model = build()
    dense = {n: p.numel() for n, p in model.named_parameters()}
    engine, _ = start_engine(model, loss_fn, make_opt, load, **init_kw)
    run = Run([], {}, [], states=[gt.full_state_dict(engine.model)] if initial else [])
    before = None
    for step, batch in enumerate(batches):
        outputs: list = []
        run.losses.append(engine_step(engine, *data_rows(batch, ctx), ctx, outputs))
        if watch is not None:
            run.watched.append(watch(engine, outputs))
        norm = engine.last_grad_norm
        run.norms.append(None if norm is None else float(norm))
        if step < grad_steps:
            after = gt.full_optimizer_state_dict(engine.model, engine.optimizer)
            run.grads.append(stepped_grads(before, after))
            before = after
    run.state = gt.full_state_dict(engine.model)
    run.shares, run.plan = shares(engine, dense), str(engine.plan)
    run.held = sum(local_numel(p) for p in engine.model.parameters())
    run.probed = probe(engine) if probe is not None else None
    return run


def start_engine(model, loss_fn, make_opt, load=None, **init_kw) -> tuple:
    """``(engine, lr scheduler or None)``: ``gt.initialize(model, optimizer, loss_fn,
    lr_scheduler=..., **init_kw)`` with ``make_opt(model)``'s optimizer (and scheduler); then
    ``gt.load_full_state_dict`` of ``load``, if given."""
    opt, sched = _optimizer(make_opt(model))
    engine, *_ = gt.initialize(model, opt, loss_fn, lr_scheduler=sched, **init_kw)
    if load is not None:
        gt.load_full_state_dict(engine.model, load)
    return engine, sched


def engine_step(engine, x, y, ctx, outputs: list | None = None) -> float | None:
    """One optimizer step on this rank's batch ``(x, y)`` (``x`` a tensor, or a dict of
    keyword inputs): the mean loss of its micro-steps where this rank sees the loss (None on
    a pipeline stage without it). ``outputs`` collects each micro-step's model output."""
    accumulation = ctx.config.gradient_accumulation
    pipeline = ctx.world_size(PM.PIPELINE) > 1
    engine.train()
    engine.zero_grad()
    losses = []
    for xm, ym in zip(_chunks(x, accumulation), _chunks(y, accumulation), strict=True):
        xm, ym = _to(xm, ctx.device), _to(ym, ctx.device)
        if pipeline:
            batch = {**xm, "labels": ym} if isinstance(xm, dict) else (xm, ym)
            _, _, loss = engine.execute_schedule(iter([batch]), return_output_label=False)
        else:
            out = _call(engine, xm)
            if outputs is not None:
                outputs.append(out)
            loss = engine.criterion(out, ym)
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


def _to(t, device):
    return {k: v.to(device) for k, v in t.items()} if isinstance(t, dict) else t.to(device)


# ---- reading runs ------------------------------------------------------------------------------
def assert_grads_close(got: dict[str, Tensor], ref: Run, step: int = 0, msg="", **tol) -> None:
    """An engine run's ``grads[step]`` against the reference's, within ``tol``
    (``torch.testing.assert_close``'s): a gradient for every parameter, each equal to the
    reference's; a tied parameter may come under each of its names (a pipeline stage lists
    its own copy)."""
    want = ref.grads[step]
    missing = set(want) - set(got)
    assert not missing, f"{msg}: no gradient for {sorted(missing)}"
    for name, g in got.items():
        dense = ref.aliases.get(name, name)
        assert dense in want, f"{msg}: {name} is no parameter of the reference"
        torch.testing.assert_close(g, want[dense], msg=f"{msg} {name}", **tol)


def global_loss(per_rank: list[float | None]) -> float:
    """The global batch's loss: the mean over ranks that report one. Every data-parallel
    rank reports the mean over its equal share of the batch, each as often as the others
    (once per rank of its model replica that sees the loss)."""
    seen = [v for v in per_rank if v is not None]
    return sum(seen) / len(seen)


def global_losses(runs: list) -> list[float]:
    """The global loss of each step from every rank's run (a ``Run`` or its list of losses)."""
    per_rank = [r.losses if isinstance(r, Run) else r for r in runs]
    return [global_loss(list(step)) for step in zip(*per_rank, strict=True)]


def local_numel(t: Tensor) -> int:
    """Elements this rank stores of ``t`` (a DTensor's local shard)."""
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def shares(engine, dense: dict[str, int]) -> dict[str, float]:
    """Dense parameter name -> the fraction of its elements this rank holds, for every
    parameter of ``engine.model`` listed under its dense name (``dense``: name -> elements)."""
    return {
        name: local_numel(p) / dense[name]
        for name, p in engine.model.named_parameters()
        if name in dense
    }


def param_share(engine, dense_numel: int) -> float:
    """Parameter elements this rank holds over those of the dense model."""
    return sum(local_numel(p) for p in engine.model.parameters()) / dense_numel


def state_numel(engine) -> int:
    """Optimizer-state elements this rank holds; scalar entries (step counts) not counted."""
    return sum(
        local_numel(v)
        for state in engine.optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )


def state_share(engine, dense_numel: int, per_param: int = 2) -> float:
    """``state_numel`` over the dense model's ``per_param`` moments per parameter (AdamW: 2)."""
    return state_numel(engine) / (per_param * dense_numel)
