"""Make the plan for a model and apply it: each planned layer replaced, in place, by its mode's
sharded layer, under the same module path (so state dict keys stay the dense ones).

``build_plan`` decides everything and checks it on meta copies of the layers
(divisibility, ties, the data flow) and on the model's forward run with this
rank's shapes (``local_shapes.py``) before a single weight moves;
``apply_plan`` then builds each sharded layer from the dense one's current
weights and returns the old -> new parameter map the optimizer is rebound with.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import get_shard_spec
from gridtrain.parallel.tensor.base import ShardedModule, describe_spec, linear_dims
from gridtrain.parallel.tensor.coverage import better_layout, count_sharded
from gridtrain.parallel.tensor.entry_input import infer_example
from gridtrain.parallel.tensor.layers import layer_for
from gridtrain.parallel.tensor.local_shapes import check_local_shapes
from gridtrain.parallel.tensor.plan import (
    COL_SHARDED,
    DROPOUT,
    EMBEDDING,
    LINEAR,
    NORM,
    OPAQUE,
    PATCH,
    ROW,
    TRACE_HOW,
    Plan,
    PlanEntry,
    PlanError,
    _bad_sinks,
    infer_1d,
    layout_of,
    match_patterns,
    model_adapter,
    orientations,
    tracked_modules,
)
from gridtrain.parallel.tensor.trace import Flow, trace_flow

logger = logging.getLogger("gridtrain")

GRID_MODES = ("2d", "2.5d", "3d")
HINT_ATTR = "gt_style"  # gt.nn layers carry their hinted style here


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan: Hugging Face's ``_tp_plan`` (full module paths), if any."""
    plan = getattr(model, "_tp_plan", None) or getattr(model, "gt_tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (no weights copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def build_plan(model: nn.Module, ctx: ParallelContext, example: Any = None) -> Plan:
    """The plan of ``model`` under ``ctx``'s layout (see ``plan.py``); raises ``PlanError``.

    ``example`` (one batch of the model's input) drives the meta trace; None builds one
    from the model's entry layer (``entry_input.py``)."""
    mode, n = ctx.tensor_mode, ctx.world_size(ParallelMode.TENSOR)
    plan = Plan(mode, n, layout=layout_of(ctx))
    if mode is None:
        count_sharded(plan, model)
        return plan
    own_plan, adapter = model_plan(model), model_adapter(model)
    if adapter is not None:  # e.g. Hugging Face: gridtrain's plan for GPT-2, head checks
        own_plan, example = adapter.plan_model(model, ctx, example)
    kinds = tracked_modules(model)
    modules = dict(model.named_modules())
    given = _given_styles(model, ctx, kinds, modules, own_plan)

    flow = None
    if mode != "sequence":  # a given plan is checked against the flow too
        needs_flow = mode in GRID_MODES or any(kinds[m] == LINEAR and m not in given for m in kinds)
        if example is None:
            example = _entry_example(model, mode, needs_flow)
        if example is not None:
            flow = trace_flow(model, example, {m: TRACE_HOW[k] for m, k in kinds.items()})
    styles, origin = _styles(mode, n, kinds, given, flow, modules)
    if flow is not None:
        plan.heads = {
            m: (linear_dims(modules[m])[1], False)
            for m in flow.order
            if kinds.get(m) == LINEAR and m in flow.output_sources
        }
    _add_entries(plan, kinds, styles, origin, flow, modules)
    _dry_run(plan, modules, ctx)
    _resolve_ties(plan, model, modules, ctx)
    plan.heads = {m: (v, plan[m].style == "vocab_parallel") for m, (v, _) in plan.heads.items()}
    if mode in GRID_MODES:
        _check_all_params_planned(plan, model, mode)
    count_sharded(plan, model)
    if flow is not None and adapter is None:  # an adapter checks its models' heads itself
        check_local_shapes(model, example, plan, flow, ctx)
    return plan


def _entry_example(model: nn.Module, mode: str, needed: bool) -> Any:
    """An input built from ``model``'s entry layer; None when the plan needs no trace and
    none can be built (the trace then only checks a plan given in full)."""
    why = (
        f"tensor mode {mode!r}: gridtrain traces the model's data flow on the meta device to "
        "pick each layer's split"
    )
    try:
        return infer_example(model, why)
    except PlanError:
        if needed:
            raise
        return None


def _given_styles(model, ctx, kinds, modules, own_plan) -> dict[str, tuple[str, str]]:
    """Module -> (style, origin) from the config's plan, ``gt.nn`` hints and the model's plan."""
    names = list(kinds)
    given: dict[str, tuple[str, str]] = {}
    cfg_plan = getattr(ctx.config.parallel.tensor, "plan", None) or {}
    for name, style in match_patterns(cfg_plan, names, "parallel.tensor.plan", True).items():
        given[name] = (style, "config")
    for name in names:
        hint = getattr(modules[name], HINT_ATTR, None)
        if hint is not None and name not in given:
            given[name] = (hint, "hint")
    own = match_patterns(own_plan, names, f"{type(model).__name__}._tp_plan", False)
    for name, style in own.items():
        given.setdefault(name, (style, "model plan"))
    _check_kinds(given, kinds)
    return given


def _styles(mode, n, kinds, given, flow, modules) -> tuple[dict[str, str], dict[str, str]]:
    """Every tracked layer's style and where it came from, under ``mode``."""
    names = list(kinds)
    if mode == "1d":
        fixed = {m: s for m, (s, _) in given.items()}
        inferred = infer_1d(kinds, fixed, flow, modules, n)
        origin = {m: given[m][1] if m in given else inferred[m][1] for m in names}
        styles = {m: s for m, (s, _) in inferred.items()}
        if flow is not None:
            _check_1d_flow(styles, kinds, flow)
        return styles, origin
    if mode in GRID_MODES:
        return _grid_styles(kinds, given, flow)
    # sequence: weights replicated, only dropout masks differ per rank
    return {m: "replicate" for m in names}, {m: "sequence: replicated" for m in names}


def _add_entries(plan: Plan, kinds, styles, origin, flow, modules) -> None:
    """One ``PlanEntry`` per tracked layer, with the options its mode's layer takes."""
    orient = orientations(kinds, flow) if plan.mode == "3d" else {}
    for name, kind in kinds.items():
        options: dict[str, Any] = {}
        style = styles[name]
        if style == "packed_colwise":
            options["packed"] = _packed_blocks(name, modules[name])
        if plan.mode == "3d" and kind != DROPOUT:
            options["orientation"] = orient.get(name, 0)
        if kind == DROPOUT and plan.mode == "1d":
            srcs = flow.sources.get(name, ()) if flow else ()
            options["sharded"] = any(styles.get(s) in COL_SHARDED for s in srcs)
        plan.entries[name] = PlanEntry(name, kind, style, origin[name], options)


def find_heads(model: nn.Module, example: Any) -> dict[str, tuple[int, bool]]:
    """Linears whose output is a model output: name -> (vocab, vocab-split logits).

    Traced here (Linears only) on ``example``, else on an input built from the model's
    entry layer."""
    kinds = {n: k for n, k in tracked_modules(model).items() if k == LINEAR}
    if example is None:
        example = infer_example(model, "chunked_loss needs to find the model's head")
    flow = trace_flow(model, example, {m: TRACE_HOW[k] for m, k in kinds.items()})
    modules = dict(model.named_modules())
    return {m: (linear_dims(modules[m])[1], False) for m in flow.order if m in flow.output_sources}


def _check_kinds(given: dict[str, tuple[str, str]], kinds: dict[str, str]) -> None:
    from gridtrain.parallel.tensor.plan import KIND_STYLES

    for name, (style, origin) in given.items():
        allowed = KIND_STYLES[kinds[name]]
        if style not in allowed:
            raise PlanError(
                f"{origin}: '{name}' is a {kinds[name]} layer; style '{style}' does not apply "
                f"(allowed: {', '.join(allowed)})"
            )


def _packed_blocks(name: str, module: nn.Module) -> int:
    hinted = getattr(module, "gt_packed", None)
    if hinted:
        return int(hinted)
    in_f, out_f, _ = linear_dims(module)
    if out_f % in_f or out_f // in_f < 2:
        raise PlanError(
            f"'{name}': packed_colwise needs the number of packed blocks; out_features "
            f"{out_f} is not a multiple of in_features {in_f} (set module.gt_packed = k)"
        )
    return out_f // in_f


def _grid_styles(kinds, given, flow: Flow):
    styles, origin = {}, {}
    heads = flow.output_sources if flow else set()
    defaults = {
        EMBEDDING: "embedding_colwise",
        NORM: "norm",
        PATCH: "colwise",
        DROPOUT: "replicate",
    }
    for name, kind in kinds.items():
        if name in given and (kind != LINEAR or given[name][0] in GRID_GIVEN):
            styles[name], origin[name] = given[name]
        elif kind == LINEAR:
            styles[name] = "gather_output" if name in heads else "auto"
            origin[name] = "traced: a model output" if name in heads else "every Linear"
        elif kind == OPAQUE:
            raise PlanError(
                f"'{name}' ({kinds[name]}) cannot run on 2d/2.5d/3d blocked activations"
            )
        else:
            styles[name], origin[name] = defaults[kind], "default"
    return styles, origin


# given styles a 2d/3d Linear keeps (any other given style becomes the mode's Linear)
GRID_GIVEN = ("gather_output", "colwise_gather_output", "vocab_parallel", "packed_colwise")


def _check_1d_flow(styles: dict[str, str], kinds: dict[str, str], flow: Flow) -> None:
    """Column layers must be read by row layers, and row layers must read column layers."""
    bad = _bad_sinks(kinds, flow)
    for name in flow.order:
        style = styles.get(name)
        if kinds.get(name) != LINEAR:
            continue
        srcs = {s for s in flow.sources.get(name, ()) if kinds.get(s) == LINEAR}
        if style in COL_SHARDED:
            if name in bad:
                raise PlanError(
                    f"1d: '{name}' is {style} but its sharded output reaches a norm, a head or "
                    "the model output without a row-parallel layer; make it "
                    "colwise_gather_output or pair it with a rowwise layer"
                )
            for reader in flow.consumers(name):
                if kinds.get(reader) == LINEAR and styles.get(reader) not in ROW:
                    raise PlanError(
                        f"1d: two column layers in a row: '{name}' ({style}) is read by "
                        f"'{reader}' ({styles.get(reader)}); the reader must be rowwise"
                    )
        if style in ROW and srcs and not all(styles.get(s) in COL_SHARDED for s in srcs):
            raise PlanError(
                f"1d: '{name}' is rowwise but reads replicated outputs of "
                f"{sorted(s for s in srcs if styles.get(s) not in COL_SHARDED)}; "
                "use rowwise_split_input or make those colwise"
            )


def _dry_run(plan: Plan, modules: dict[str, nn.Module], ctx: ParallelContext) -> None:
    """Build every sharded layer from a meta copy: checks divisibility, records shard shapes."""
    for name, entry in plan.entries.items():
        factory, options = layer_for(ctx, name, entry.kind, entry.style, entry.options)
        entry.shards, entry.specs, entry.layer = {}, {}, ""
        if factory is None:
            continue
        try:
            layer = factory(meta_twin(modules[name]), ctx, **options)
        except (ValueError, TypeError) as err:
            raise PlanError(f"'{name}' as {entry.style}: {err}") from None
        entry.layer = type(layer).__name__
        dense = dict(modules[name].named_parameters(recurse=False))
        for pname, p in layer.named_parameters(recurse=False):
            if pname in dense:
                entry.shards[pname] = (tuple(dense[pname].shape), tuple(p.shape))
        entry.specs = {n: get_shard_spec(p) for n, p in layer.named_parameters(recurse=False)}


def _resolve_ties(plan: Plan, model: nn.Module, modules, ctx: ParallelContext) -> None:
    """Weights shared by two planned layers must be cut the same way in both."""
    users: dict[int, list[tuple[str, str]]] = {}
    for name in plan.entries:
        for pname, p in modules[name].named_parameters(recurse=False):
            users.setdefault(id(p), []).append((name, pname))
    for shared in users.values():
        if len(shared) < 2:
            continue
        first, first_p = shared[0]
        want = plan[first].specs.get(first_p, ())
        for name, pname in shared[1:]:
            entry = plan[name]
            if entry.specs.get(pname, ()) == want:
                continue
            if entry.origin in ("config", "hint") or entry.kind != LINEAR:
                raise PlanError(_tie_error(plan, first, first_p, name, pname, want))
            for style in _TIE_ALTERNATIVES[ctx.tensor_mode]:
                entry.style, entry.origin = style, f"tied to {first}.{first_p}"
                _dry_run(Plan(plan.mode, plan.size, {name: entry}), modules, ctx)
                if entry.specs.get(pname, ()) == want:
                    break
            else:
                raise PlanError(_tie_error(plan, first, first_p, name, pname, want))


_TIE_ALTERNATIVES = {
    "1d": ("colwise_gather_output", "rowwise_split_input", "vocab_parallel", "replicate"),
    "2d": ("gather_output", "vocab_parallel"),
    "2.5d": ("gather_output", "vocab_parallel"),
    "3d": ("gather_output", "vocab_parallel"),
    "sequence": ("replicate",),
}


def _tie_error(plan, first, first_p, name, pname, want) -> str:
    return (
        f"'{name}.{pname}' is tied to '{first}.{first_p}', which is split "
        f"{describe_spec(want)} as {plan[first].style}; no style of '{name}' cuts it the "
        "same way: choose matching styles in parallel.tensor.plan"
    )


def _check_all_params_planned(plan: Plan, model: nn.Module, mode: str) -> None:
    covered = {
        id(p)
        for name, e in plan.entries.items()
        if e.layer
        for p in model.get_submodule(name).parameters()
    }
    loose = [n for n, p in model.named_parameters() if id(p) not in covered]
    if loose:
        more = f" ... and {len(loose) - 8} more" if len(loose) > 8 else ""
        raise PlanError(
            f"tensor mode {mode!r} blocks every activation over the grid, so every parameter "
            f"must belong to a layer gridtrain shards (Linear, Embedding, a norm, "
            f"gt.nn.PatchEmbedding); these do not: {', '.join(loose[:8])}{more}. "
            f"{better_layout(model, sentence=True)}"
        )


def apply_plan(model: nn.Module, plan: Plan, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    """Replace every planned layer of ``model`` in place; returns id(old param) -> new param."""
    new_of: dict[int, nn.Parameter] = {}
    built: list[ShardedModule] = []
    for name, entry in plan.entries.items():
        factory, options = layer_for(ctx, name, entry.kind, entry.style, entry.options)
        if factory is None:
            continue
        dense = model.get_submodule(name)
        old = dict(dense.named_parameters(recurse=False))
        layer = factory(dense, ctx, **options)
        for pname, p in old.items():
            if id(p) in new_of:
                layer.tie(pname, new_of[id(p)])
            elif getattr(layer, pname, None) is not None:
                new_of[id(p)] = getattr(layer, pname)
        model.set_submodule(name, layer)
        if isinstance(layer, ShardedModule):
            built.append(layer)
    for layer in built:
        layer.release_dense()
    adapter = model_adapter(model)
    if adapter is not None:  # runtime fixes the model's own code needs (local head counts...)
        adapter.after_apply(model, plan, ctx)
    logger.info("tensor plan applied: %d layers replaced", len(built))
    return new_of
