"""How much of a model a tensor plan shards, and the advice when it is little.

Tensor parallelism pays for its collectives only where it splits the weights
that dominate a model: Linear and embedding layers. A convolutional network
under 1d gets only its classifier split, and 2d/2.5d/3d cannot run it at all.
``count_sharded`` fills ``Plan.params`` / ``Plan.params_sharded`` (printed with the
plan); ``coverage_notice`` is the line rank 0 logs when less than half of the
parameters are sharded, and ``better_layout`` the advice it and the 2d/2.5d/3d
error end with.
"""

from __future__ import annotations

from torch import nn

from gridtrain.parallel.tensor.plan import OPAQUE, Plan

LOW_COVERAGE = 0.5  # below this fraction of sharded parameters, initialize says so


def count_sharded(plan: Plan, model: nn.Module) -> None:
    """Set ``plan.params`` (dense parameters, a tied weight once) and ``plan.params_sharded``
    (those the plan splits, or that an already-parallel layer holds in shards)."""
    owner: dict[int, tuple[str, str]] = {}
    for name, entry in plan.entries.items():
        mine = model.get_submodule(name).named_parameters(recurse=entry.kind != OPAQUE)
        for pname, p in mine:  # a replaced layer's children (out_proj) are its own
            owner.setdefault(id(p), (name, pname))
    total = sharded = 0
    for p in model.parameters():  # each tied weight once
        total += p.numel()
        name, pname = owner.get(id(p), ("", ""))
        entry = plan.entries.get(name)
        if entry is None:
            continue
        dense, local = entry.shards.get(pname, ((), ()))
        if dense != local or entry.kind == OPAQUE:
            sharded += p.numel()
    plan.params, plan.params_sharded = total, sharded


def sharded_layers(plan: Plan) -> list[str]:
    """The layers whose parameters the plan splits."""
    return [n for n, e in plan.entries.items() if any(d != s for d, s in e.shards.values())]


def better_layout(model: nn.Module, sentence: bool = False) -> str:
    """Which parallelism serves ``model`` better than a tensor mode that barely shards it
    (``sentence``: capitalised, to start one)."""
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    what = (
        "a convolutional model"
        if convolutional
        else "a model whose weights are mostly outside Linear and embedding layers"
    )
    return (
        f"{'F' if sentence else 'f'}or {what}, data parallelism (no parallel.tensor) or ZeRO "
        "(zero = dict(stage=1|2|3)) serves better"
    )


def coverage_notice(plan: Plan, model: nn.Module) -> str | None:
    """One line when ``plan`` shards less than half of ``model``'s parameters under a mode
    that splits weights (1d, 2d, 2.5d, 3d); None otherwise."""
    from gridtrain.parallel.tensor.registry import mode_spec  # the modes' specs use this file

    if not mode_spec(plan.mode).splits_weights or not plan.params:
        return None
    if plan.sharded_fraction >= LOW_COVERAGE:
        return None
    layers = sharded_layers(plan)
    which = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"tensor mode {plan.mode!r} shards {plan.sharded_fraction:.1%} of "
        f"{type(model).__name__}'s parameters ({which or 'no layer'}); the rest is repeated on "
        f"each of the {plan.size} tensor ranks: {better_layout(model)}"
    )
